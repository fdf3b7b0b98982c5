"""``/docs`` served offline: Swagger UI's assets from the ``swagger-ui-bundle`` package.

FastAPI's default ``/docs`` page loads Swagger UI from a CDN and ``/redoc``
loads ReDoc the same way; neither works on an air-gapped host. Here
``/docs`` references only ``/docs-assets/*`` on this server and ``/redoc``
is off.
"""

from __future__ import annotations

from pathlib import Path

import swagger_ui_bundle  # type: ignore[import-untyped]
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_PREFIX", "install_docs"]

ASSETS_PREFIX = "/docs-assets"


def _assets_dir() -> Path:
    path = Path(str(swagger_ui_bundle.swagger_ui_path))
    if not (path / "swagger-ui-bundle.js").is_file():
        raise RuntimeError(f"swagger-ui-bundle has no swagger-ui-bundle.js in {path}; "
                           "reinstall it: pip install --force-reinstall swagger-ui-bundle")
    return path


def install_docs(app: FastAPI) -> None:
    """Mount the assets and the ``/docs`` page (the app is built with ``docs_url=None``)."""
    app.mount(ASSETS_PREFIX, StaticFiles(directory=_assets_dir()), name="docs-assets")
    title = f"{app.title} {app.version}: API"

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=title,
            swagger_js_url=f"{ASSETS_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PREFIX}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None})
