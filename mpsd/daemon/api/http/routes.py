"""The URL paths of Triton's HTTP/REST protocol (KServe v2 and Triton's extensions) and their handlers.

Paths and methods are those of Triton's HTTP server (src/http_server.cc): a version in a path is a
number, a path that matches nothing is 404 and a known path asked with another method 405, both with
Triton's JSON error body.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from aiohttp import web
from aiohttp.typedefs import Handler

from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.status_view import StatusView
from mpsd.daemon.api.web import Mount
from mpsd.net.auth import AccessPolicy

from .generate import GenerateHandler
from .handlers import Handlers
from .infer import InferHandler
from .middleware import Admission
from .status import add_status_routes

MODEL = "/v2/models/{model}"
VERSION = "/v2/models/{model}/versions/{version:[0-9]+}"
REPOSITORY = ("/v2/repository", "/v2/repository/{repository}")
SHM = "/v2/systemsharedmemory"
CUDA_SHM = "/v2/cudasharedmemory"


def add_routes(app: web.Application, ops: Operations, limit: int, admission: Admission) -> None:
    h = Handlers(ops)
    infer = InferHandler(ops, limit)
    generate = GenerateHandler(ops, limit)

    def get(path: str, handler: Handler, allow_head: bool = True) -> None:
        app.router.add_get(path, handler, allow_head=allow_head, expect_handler=admission.expect)

    def post(path: str, handler: Handler) -> None:
        app.router.add_post(path, handler, expect_handler=admission.expect)

    get("/v2/health/live", h.live)  # HEAD as well, for load balancers' checks
    get("/v2/health/ready", h.ready)
    get("/v2", h.server_metadata, allow_head=False)
    get("/v2/models/stats", h.statistics, allow_head=False)
    for model in (MODEL, VERSION):
        get(model, h.model_metadata, allow_head=False)
        get(f"{model}/ready", h.model_ready, allow_head=False)
        get(f"{model}/config", h.model_config, allow_head=False)
        get(f"{model}/stats", h.statistics, allow_head=False)
        post(f"{model}/infer", infer.infer)
        post(f"{model}/generate", generate.generate)
        post(f"{model}/generate_stream", generate.generate_stream)
    for repository in REPOSITORY:
        post(f"{repository}/index", h.index)
        post(f"{repository}/models/{{model}}/load", h.load)
        post(f"{repository}/models/{{model}}/unload", h.unload)
    get(f"{SHM}/status", h.shm_status, allow_head=False)
    get(f"{SHM}/region/{{region}}/status", h.shm_status, allow_head=False)
    post(f"{SHM}/region/{{region}}/register", h.shm_register)
    post(f"{SHM}/unregister", h.shm_unregister)
    post(f"{SHM}/region/{{region}}/unregister", h.shm_unregister)
    get(f"{CUDA_SHM}/status", h.cuda_shm_status, allow_head=False)
    get(f"{CUDA_SHM}/region/{{region}}/status", h.cuda_shm_status, allow_head=False)
    post(f"{CUDA_SHM}/region/{{region}}/register", h.cuda_shm_register)
    post(f"{CUDA_SHM}/region/{{region}}/unregister", h.cuda_shm_unregister)
    post(f"{CUDA_SHM}/unregister", h.cuda_shm_unregister)
    for trace in ("/v2/trace/setting", f"{MODEL}/trace/setting"):
        get(trace, h.trace, allow_head=False)
        post(trace, h.trace)
    get("/v2/logging", h.log_settings, allow_head=False)
    post("/v2/logging", h.log_settings)


def build_app(
    ops: Operations,
    policy: AccessPolicy,
    limit: int,
    view: StatusView | None,
    mounts: Sequence[Mount] = (),
    kserve: bool = True,
) -> tuple[web.Application, Admission]:
    """The application serving `ops` with KServe's routes and the status page of `view` (unless `kserve`
    is false: then the mounted adapters own every path, their errors included) and those of the adapters
    mounted beside them; bodies over `limit` bytes are refused (413)."""
    if not kserve:
        mounts = [replace(m, prefix="/") for m in mounts]
    admission = Admission(policy, ops.shutting_down, limit, ops.refusing, mounts)
    app = web.Application(middlewares=[admission], client_max_size=limit)
    if kserve:
        add_routes(app, ops, limit, admission)
    if view is not None:
        add_status_routes(app, view, admission)
    for mount in mounts:
        mount.add_routes(app, admission.expect)
    return app, admission
