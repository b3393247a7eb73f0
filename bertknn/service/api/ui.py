"""``GET /ui``: the playground, static files of the package (no CDN, no build step) over the public API; ``GET /``
leads a browser there."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import RedirectResponse

router = APIRouter(include_in_schema=False)
_TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}  # fmt: skip
# read once at import: the page keeps working on a read-only root filesystem
_FILES = {name: (files("bertknn.service") / "ui" / name).read_bytes() for name in _TYPES}
_HEADERS = {
    # only this origin: the page's own script and style, and the API it calls; inline style attributes for the bars
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "script-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    if name not in _FILES:
        raise HTTPException(404, f"no playground file {name!r}; the page is /ui")
    return Response(_FILES[name], media_type=_TYPES[name], headers=_HEADERS)


@router.get("/")
async def home(request: Request) -> RedirectResponse:
    """The address a browser opens first: to the playground (under the app's root path, behind a proxy too)."""
    return RedirectResponse(request.url_for("playground").path, status_code=307)


@router.get("/ui")
async def playground() -> Response:
    return _file("index.html")


@router.get("/ui/{name}")
async def playground_file(name: str) -> Response:
    return _file(name)
