"""``/docs`` and ``/redoc`` served offline, from the assets of the ``fastapi-offline`` package.

FastAPI's default pages load Swagger UI and ReDoc from a CDN; neither works
on an air-gapped host. Here both pages reference only ``/docs-assets/*`` on
this server. The package bundles Swagger UI 5 (Swagger UI 4 cannot read the
OpenAPI 3.1 document FastAPI serves).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS", "ASSETS_PREFIX", "install_docs"]

ASSETS_PREFIX = "/docs-assets"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def _assets_dir() -> Path:
    path = Path(str(files("fastapi_offline") / "static"))
    missing = [name for name in ASSETS if not (path / name).is_file()]
    if missing:
        raise RuntimeError(
            f"fastapi-offline has no {', '.join(missing)} in {path}; "
            "reinstall it: pip install --force-reinstall fastapi-offline"
        )
    return path


def install_docs(app: FastAPI) -> None:
    """Mount the assets and the two pages (the app is built with ``docs_url=None``)."""
    app.mount(ASSETS_PREFIX, StaticFiles(directory=_assets_dir()), name="docs-assets")
    title = f"{app.title} {app.version}: API"
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=f"{ASSETS_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PREFIX}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{ASSETS_PREFIX}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_PREFIX}/favicon.png",
            with_google_fonts=False,
        )
