"""The chat page: ``GET /`` (HTML), ``GET /static/chat.js`` and ``GET /static/chat.css``.

Plain files shipped in the package (``static/``), no build step and nothing fetched from
another host: the page talks to this server's own ``/v1/models`` and ``/v1/chat/completions``
(streamed), so it works wherever the server does, offline included. The page itself is not
under ``/v1`` and so loads without the API key; the key, typed into the page, goes with each
``/v1`` call as ``Authorization: Bearer``.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

#: Only this server's own files and API: a strict policy shows at once in the browser (a
#: console error) if a change ever pulls a script, a style or a font from elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

#: file name -> media type of what ``static/`` holds and the server serves
FILES = {
    "chat.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}


def _read(name: str) -> bytes:
    """One file of ``static/`` (read from the installed package, wheel or editable)."""
    return resources.files(__package__).joinpath("static", name).read_bytes()


def register_chat_page(app: FastAPI) -> None:
    """Serve the chat page at ``/`` and its script and style under ``/static/``.

    The files are read once here (a few KiB), so a missing file fails the server's start
    rather than the first page view.
    """
    bodies = {name: _read(name) for name in FILES}
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        # no-cache, not no-store: the browser revalidates, so an upgraded server's page is
        # picked up on the next load
        "Cache-Control": "no-cache",
    }

    def page(name: str) -> Response:
        return Response(bodies[name], media_type=FILES[name], headers=headers)

    # HEAD too (FastAPI does not add it to a GET route): ``curl -I`` and uptime checks use it
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return page("chat.html")

    @app.get("/static/chat.js", include_in_schema=False)
    async def chat_script() -> Response:
        return page("chat.js")

    @app.get("/static/chat.css", include_in_schema=False)
    async def chat_style() -> Response:
        return page("chat.css")
