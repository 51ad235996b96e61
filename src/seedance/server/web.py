"""The playground at ``/`` and the browser SDK at ``/sdk/``: files of the package, served as
they are (no build step, no CDN), under a content security policy that lets the page load
nothing but Seedance's own files and talk to nothing but Seedance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

WEB = Path(__file__).resolve().parent.parent / "web"

# The page's own scripts and styles, its worker, and WebSockets to its own host: model output
# that slipped past the renderer's escaping still could not load or run anything.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; worker-src 'self'; style-src 'self'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _Files(StaticFiles):
    """Static files with the security headers (and JavaScript as JavaScript everywhere)."""

    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        if path.endswith(".js"):
            response.headers["Content-Type"] = "text/javascript; charset=utf-8"
        response.headers.update(SECURITY_HEADERS)
        return response


async def _index(_: Any) -> Response:
    return FileResponse(WEB / "playground" / "index.html", headers=SECURITY_HEADERS)


async def _no_icon(_: Any) -> Response:
    return Response(status_code=204)  # browsers ask for one; a 404 would show as an error


def web_routes() -> list[BaseRoute]:
    return [
        Route("/", _index, methods=["GET", "HEAD"]),
        Route("/favicon.ico", _no_icon, methods=["GET", "HEAD"]),
        Mount("/playground", _Files(directory=WEB / "playground"), name="playground"),
        Mount("/sdk", _Files(directory=WEB / "js"), name="sdk"),
    ]
