"""The chat page at `/` (web/: static HTML, JS and CSS, no build step, nothing fetched from
elsewhere), the way llama.cpp's server ships one: it streams /v1/chat/completions, shows the
answer at the reader's pace and posts the read cursor as the reader reads (web/chat.js), so the
engine's model of that reader's buffer follows real reading. Off with `--no-web-ui`.

The page is public like /health; what it calls is /v1/*, behind the API key the user types into
it (kept in the browser tab's sessionStorage, sent only as the Authorization header).
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB = Path(__file__).with_name("web")
FILES = {"index.html": "text/html", "chat.js": "text/javascript", "chat.css": "text/css"}
HEADERS = {
    # the page's own files and its own origin's API only; never framed by another site
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> web.Response:
    return web.Response(body=(WEB / name).read_bytes(), content_type=FILES[name], charset="utf-8", headers=HEADERS)


async def index(request: web.Request) -> web.Response:
    return _file("index.html")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in FILES or name == "index.html":
        raise web.HTTPNotFound(text=f"no file {name!r} in the chat page")
    return _file(name)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/ui/{name}", asset)
