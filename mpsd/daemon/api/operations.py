"""What each KServe operation does, whatever the protocol that asked for it.

The gRPC servicer and the HTTP routes are two adapters over these: they translate their protocol's
request into the arguments here and the result back, so both protocols answer alike (the same checks,
the same errors, the same batching, queues and statistics), and neither is a second implementation.
Here are the management operations (health, metadata, statistics, the repository, shared-memory
registration, settings); inference is `pipeline.py`'s, which `Operations` inherits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

import mpsd
from mpsd.config.daemon_config import TraceConfig
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.client_shm import ClientRegion, ClientShmRegistry
from mpsd.daemon.api.cuda_shm import CudaRegion, open_region
from mpsd.daemon.api.parse import check_name
from mpsd.daemon.api.pipeline import Answered as Answered  # the adapters' result type, from here too
from mpsd.daemon.api.pipeline import Pipeline
from mpsd.daemon.api.trace_settings import Update
from mpsd.daemon.api.tracing import Tracing
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.overrides import LoadParameters
from mpsd.daemon.core.registry import IndexRow, Registry
from mpsd.daemon.core.requests import Stages
from mpsd.daemon.core.response_cache import ResponseCache
from mpsd.daemon.core.versions import requested_version
from mpsd.daemon.supervise.gpus import daemon_cuda_gpus
from mpsd.errors import FailedPrecondition, InvalidArgument, LoadError, MpsdError, NotFound, UnknownModel

log = structlog.get_logger("mpsd.daemon.api")

SERVER_NAME = "mpsd"  # the daemon config's `server_name` by default
EXTENSIONS = [
    "model_repository",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "logging",
    "system_shared_memory",
    "trace",
]


class Operations(Pipeline):
    """The operations on the daemon's state that clients can ask for (inference: `Pipeline`)."""

    def __init__(
        self,
        registry: Registry,
        shutting_down: Callable[[], bool],
        model_control: str = "watch",
        client_shm: ClientShmRegistry | None = None,
        refusing: Callable[[], bool] | None = None,
        server_name: str = SERVER_NAME,
        response_cache: ResponseCache | None = None,
        tracing: Tracing | None = None,
        stages: Stages | None = None,
    ) -> None:
        self.registry = registry
        self.tracing = tracing if tracing is not None else Tracing(TraceConfig())
        # The stages every source's requests pass (core/requests.py): the response cache (None: off) and the
        # trace settings' decision for requests made for another; the registry's, shared with models' calls
        # and ensembles' steps.
        self.stages = stages if stages is not None else Stages()
        self.stages.cache = response_cache
        self.stages.tracer = self.tracing
        self.server_name = server_name  # what ServerMetadata says the server is
        self.shutting_down = shutting_down  # health and readiness say no from the stop signal on
        # new calls are refused once the shutdown grace is over (at once, when not told)
        self.refusing = refusing if refusing is not None else shutting_down
        self.model_control = model_control
        self.client_shm = client_shm if client_shm is not None else ClientShmRegistry()

    # ---- health and metadata ---------------------------------------------------------------------

    def live(self) -> bool:
        """Live while it drains too, as Triton: a liveness probe must not restart a daemon finishing work."""
        return True

    def ready(self) -> bool:
        return not self.shutting_down() and self.registry.server_ready()

    def server_metadata(self) -> dict[str, Any]:
        """Triton's server metadata. `cuda_shared_memory` is listed where the NVIDIA driver shows this
        daemon a GPU, so a client can tell whether registering CUDA memory can work at all."""
        cuda = ["cuda_shared_memory"] if daemon_cuda_gpus() else []
        return {"name": self.server_name, "version": mpsd.__version__, "extensions": EXTENSIONS + cuda}

    def model_ready(self, name: str, version: str) -> bool:
        return not self.shutting_down() and self.registry.model_ready(name, version)

    def model(self, name: str, version: str) -> tuple[ModelVersion, list[str]]:
        """The version that answers for (name, version), and every version of the model served now."""
        mv = self.registry.route(name, version)
        return mv, [str(v.version) for v in self.registry.versions(name)]

    def metadata(self, name: str, version: str) -> tuple[ModelConfig, list[str]]:
        """The config and served versions for ModelMetadata, also of a model that loads on demand and is
        not running (from its repository files, without loading it)."""
        entry = self.registry.entries.get(name)
        source = entry.source if entry is not None and not entry.versions else None
        if (
            source is None
            or source.config is None
            or entry is None
            or not self.registry.residency.cold(entry)
        ):
            mv, versions = self.model(name, version)
            return mv.config, versions
        number = requested_version(version)
        if number is not None and number not in source.versions:
            raise UnknownModel(name, number)
        return source.config, [str(v) for v in source.versions]

    def models(self) -> list[tuple[str, ModelConfig, str]]:
        """Every model known, with the config it serves (or loads with, when it loads on demand) and its
        state: READY, UNLOADED (it loads on its next request), LOADING or UNAVAILABLE. Models whose config
        could not be read are left out."""
        known = []
        for name in sorted(self.registry.entries):
            entry = self.registry.entries[name]
            if entry.versions:
                config = entry.versions[max(entry.versions)].config
            elif entry.source is not None and entry.source.config is not None:
                config = entry.source.config
            else:
                continue
            cold = self.registry.residency.cold(entry) and entry.error is None
            known.append((name, config, "UNLOADED" if cold else entry.state.value))
        return known

    def statistics(self, name: str, version: str) -> list[ModelVersion]:
        """The versions whose statistics are asked for: one, a model's, or every model's ("" names); with
        Triton's answers for a model or version that has none ready (INVALID_ARGUMENT there)."""
        if not name:
            return [mv for model in sorted(self.registry.entries) for mv in self.registry.versions(model)]
        number = requested_version(version)
        served = self.registry.versions(name)
        if not served:
            raise InvalidArgument(f"requested model '{name}' is not available")
        if number is None:
            return served
        chosen = [mv for mv in served if mv.version == number]
        if not chosen:
            raise InvalidArgument(f"requested model version is not available for model '{name}'")
        return chosen

    # ---- repository ----------------------------------------------------------------------------------

    def index(self, repository: str, ready_only: bool) -> list[IndexRow]:
        if repository:
            raise NotFound(f"unknown repository '{repository}' (mpsd serves one repository)")
        return self.registry.index(ready_only=ready_only)

    async def load(self, repository: str, name: str, params: LoadParameters | None = None) -> None:
        """(Re)load one model, from the repository or with the `config` and files the request brought."""
        self._check_repository(repository)
        check_name("model", name)
        try:
            await self.registry.load_model(name, params)
        except LoadError as exc:
            raise MpsdError(f"failed to load '{name}': {exc}") from None

    async def unload(self, repository: str, name: str) -> None:
        self._check_repository(repository)
        check_name("model", name)
        await self.registry.unload_model(name, explicit=True)

    def _check_repository(self, name: str) -> None:
        if self.model_control == "none":
            raise FailedPrecondition(
                "model control is 'none': models cannot be loaded or unloaded at runtime"
            )
        if name:
            raise NotFound(f"unknown repository '{name}' (mpsd serves one repository)")

    # ---- system shared memory ------------------------------------------------------------------------

    def shm_status(self, name: str) -> list[ClientRegion]:
        return self.client_shm.status(name)

    def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.client_shm.register(name, key, offset, byte_size)
        log.info("shared memory registered", region=name, key=key, offset=offset, byte_size=byte_size)

    def shm_unregister(self, name: str) -> None:
        self.client_shm.unregister(name)
        log.info("shared memory unregistered", region=name or "(all)")

    # ---- CUDA shared memory -------------------------------------------------------------------------

    def cuda_shm_status(self, name: str) -> list[CudaRegion]:
        return self.client_shm.cuda_status(name)

    async def cuda_shm_register(self, name: str, handle: bytes, device_id: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("'region name' is necessary to register cuda shared memory region")
        self.client_shm.check_cuda_name(name)
        if byte_size == 0:
            raise InvalidArgument(f"shared memory region '{name}': byte_size must be positive")
        region = await open_region(name, handle, device_id, byte_size)
        self.client_shm.register_cuda(region)
        log.info("cuda shared memory registered", region=name, device_id=device_id, byte_size=byte_size)

    def cuda_shm_unregister(self, name: str) -> None:
        self.client_shm.unregister(name, CudaRegion)
        log.info("cuda shared memory unregistered", region=name or "(all)")

    # ---- settings ------------------------------------------------------------------------------------

    def trace_setting(self, model: str, update: Update, http: bool = False) -> dict[str, list[str]]:
        """Triton's trace settings of `model` ("": the global ones), after `update` (none: only reads)."""
        return self.tracing.setting(self.registry, model, update, http)

    @staticmethod
    def log_settings(updates: Mapping[str, bool | int | str]) -> dict[str, bool | int | str]:
        """Triton's runtime log settings, mapped onto mpsd's one output level; no updates only reads."""
        from mpsd.logs import apply_log_settings

        current = apply_log_settings(updates)
        if updates:
            log.info("log settings changed", **{k: current[k] for k in updates})
        return current
