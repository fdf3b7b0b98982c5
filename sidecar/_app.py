"""The app factory and its lifespan (which owns the database and the HTTP client)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from ._autopilot import Autopilot
from ._body_limit import BodyLimitMiddleware
from ._docs_ui import install_docs
from ._metrics import Metrics
from ._problems import install_problem_handlers
from ._retention import Retention
from ._routes import devices, engines, health, instances, watch
from ._service import InstanceService
from ._settings import SidecarSettings
from ._store import Store
from ._transport import UnixSocketRouter
from ._version import version
from ._waits import WaitSlots

__all__ = ["create_app"]

_DESCRIPTION = """\
Desired KV-cache limits per instance, pushed to each engine's control socket.
Sizes are byte counts or strings with a binary unit (`512M`, `2G`, `1.5GiB`);
`null` means unlimited. Errors are `application/problem+json`.
"""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: SidecarSettings = app.state.settings
    store = Store(settings.db_path)
    await store.open()
    router = UnixSocketRouter()
    client = httpx.AsyncClient(transport=router, timeout=settings.push_timeout_s)
    waits = WaitSlots(settings.wait_slots)
    metrics = Metrics()
    metrics.add_waits(waits)
    service = InstanceService(store, client, settings, metrics, router=router)
    autopilot = Autopilot(store, service, settings, metrics)
    retention = Retention(service, autopilot.forget, settings, metrics)
    try:
        await service.start()
        await autopilot.start()
        retention.start()
        app.state.service = service
        app.state.autopilot = autopilot
        app.state.metrics = metrics
        app.state.waits = waits
        app.state.watch_listing = watch.SharedListing(service)  # shared by the event streams
        app.state.retention = retention
        yield
    finally:
        await retention.close()
        await autopilot.close()
        await service.close()
        await client.aclose()
        await store.close()


def create_app(settings: SidecarSettings | None = None) -> FastAPI:
    """A sidecar app; ``settings`` default to the environment (``KVSIDECAR_*``)."""
    settings = settings if settings is not None else SidecarSettings()
    app = FastAPI(
        title="kvsidecar",
        version=version(),
        description=_DESCRIPTION,
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
    )  # both: _docs_ui
    app.state.settings = settings
    install_problem_handlers(app)
    install_docs(app)
    app.include_router(instances.router)
    app.include_router(devices.router)
    app.include_router(engines.router)
    app.include_router(health.router)
    token = None if settings.token is None else settings.token.get_secret_value()
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, token=token)
    return app
