"""The interactive API page (``/docs``) from Swagger UI assets served by this process: no CDN, so it works on an
air-gapped cluster. The assets come from the ``swagger-ui-py`` package (a maintained copy of swagger-ui-dist)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def swagger_assets_dir() -> Path:
    import swagger_ui

    return Path(swagger_ui.__file__).parent / "static"


def install_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI) with its scripts and styles under ``/docs/assets``; create the app with
    ``docs_url=None, redoc_url=None`` so that FastAPI's CDN pages are not installed."""
    app.mount(ASSETS, StaticFiles(directory=swagger_assets_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )
