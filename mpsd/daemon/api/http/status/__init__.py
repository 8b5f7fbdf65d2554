"""The status page on the HTTP port: small files shipped in this package (HTML, JavaScript, CSS and an
icon; no build step, nothing fetched from elsewhere) and the JSON document they poll.

The files are the same for everyone and say nothing about the daemon, so they are served to whoever may
connect; the document has the access category of `ListWorkers` (logs-statistics), which the page asks
for with the token the operator types in when the daemon wants one.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from mpsd.daemon.api.status_view import StatusView

from ..handlers import rpc
from ..middleware import Admission
from ..responses import json_response

PATH = "/status"
LIST_WORKERS = "/mpsd.v1.MpsdAdmin/ListWorkers"  # the RPC whose access category the document has
FILES = {
    "": ("index.html", "text/html"),
    "status.js": ("status.js", "text/javascript"),
    "status.css": ("status.css", "text/css"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}
# The page runs nothing but its own files, in no frame of another site.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class StatusPage:
    def __init__(self, view: StatusView) -> None:
        self.view = view
        here = resources.files(__package__)
        self._files = {
            name: (here.joinpath(file).read_bytes(), content_type)
            for name, (file, content_type) in FILES.items()
        }

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(f"{PATH}/")

    async def file(self, request: web.Request) -> web.Response:
        body, content_type = self._files[request.match_info.get("file", "")]
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=HEADERS)

    @rpc(LIST_WORKERS)
    async def document(self, request: web.Request) -> web.Response:
        response = json_response(self.view.document())
        response.headers["Cache-Control"] = "no-store"
        return response


def add_status_routes(app: web.Application, view: StatusView, admission: Admission) -> None:
    page = StatusPage(view)
    expect = admission.expect
    app.router.add_get(PATH, page.redirect, allow_head=False)
    app.router.add_get(f"{PATH}/", page.file, expect_handler=expect)
    app.router.add_get(
        f"{PATH}/{{file:status\\.js|status\\.css|favicon\\.svg}}", page.file, expect_handler=expect
    )
    app.router.add_get(f"{PATH}/status.json", page.document, allow_head=False, expect_handler=expect)
