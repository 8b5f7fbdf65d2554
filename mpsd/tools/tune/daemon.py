"""The RPCs `mpsd tune` makes to the daemon: the model's metadata and served config, loads with a `config`
parameter (the repository is never written), batch statistics, and the workers' memory and budgets.

mpsd's own stubs, as the other tools use (mpsd/tools/client.py), on one channel."""

from __future__ import annotations

import json
from typing import Any

import grpc

from mpsd.tools.client import inference_stub, rpc_failure
from mpsd.tools.infer import TensorMeta

# The snapshot counter that measures a worker on each kind of device (as the daemon's residency reads it).
MEMORY_COUNTER = {"cpu": "rss_bytes", "cuda": "reserved_bytes", "mps": "driver_allocated_bytes"}


class LoadFailed(Exception):
    """The daemon did not load the trial's config; `refused` when its memory budget said no."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.message = message
        self.refused = refused


class Daemon:
    """One model of a running daemon, as the tuner sees it."""

    def __init__(self, channel: grpc.Channel, address: str, model: str, timeout: float) -> None:
        from mpsd.proto import admin_pb2_grpc

        self.model = model
        self.timeout = timeout
        self.stub = inference_stub(channel, address, timeout)
        self.admin = admin_pb2_grpc.MpsdAdminStub(channel)  # type: ignore[no-untyped-call]

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise rpc_failure(exc) from None

    def inputs(self) -> list[TensorMeta]:
        from mpsd.proto import grpc_service_pb2 as pb

        meta = self._call(self.stub.ModelMetadata, pb.ModelMetadataRequest(name=self.model))
        return [TensorMeta(t.name, t.datatype, tuple(int(d) for d in t.shape)) for t in meta.inputs]

    def served_config(self) -> dict[str, Any]:
        """The config the model serves now, as Triton's JSON (field names as in config.pbtxt)."""
        from google.protobuf import json_format  # type: ignore[import-untyped]

        from mpsd.proto import grpc_service_pb2 as pb

        response = self._call(self.stub.ModelConfig, pb.ModelConfigRequest(name=self.model))
        served: dict[str, Any] = json_format.MessageToDict(response.config, preserving_proto_field_name=True)
        return served

    def load(self, config: dict[str, Any] | None, timeout: float) -> None:
        """Load the model with `config` (partial: the repository's config gives the rest), or as the
        repository has it (None). The daemon answers once the new config serves; requests meanwhile are
        served by the old one."""
        from mpsd.proto import grpc_service_pb2 as pb

        request = pb.RepositoryModelLoadRequest(model_name=self.model)
        if config is not None:
            request.parameters["config"].string_param = json.dumps(config)
        try:
            self.stub.RepositoryModelLoad(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            details = str(exc.details())  # type: ignore[attr-defined]
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "memory budget" in details:
                raise LoadFailed(details, refused=True) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED) or (
                code == grpc.StatusCode.PERMISSION_DENIED
            ):
                raise rpc_failure(exc) from None  # not the trial's fault: the tuner cannot go on
            raise LoadFailed(details, refused=False) from None

    def batch_stats(self) -> dict[int, int]:
        """Executions per batch size so far, over the model's versions."""
        from mpsd.proto import grpc_service_pb2 as pb

        stats = self._call(self.stub.ModelStatistics, pb.ModelStatisticsRequest(name=self.model))
        counts: dict[int, int] = {}
        for version in stats.model_stats:
            for b in version.batch_stats:
                counts[int(b.batch_size)] = counts.get(int(b.batch_size), 0) + int(b.compute_infer.count)
        return counts

    def workers(self) -> Any:
        from mpsd.proto import admin_pb2

        return self._call(self.admin.ListWorkers, admin_pb2.ListWorkersRequest())


def device_of(listing: Any, model: str) -> str:
    """The kind of device the model's workers run on (cpu, cuda, mps); cpu before any has reported."""
    for w in listing.workers:
        if w.model == model and w.device.kind:
            return str(w.device.kind)
    return "cpu"


def worker_memory(listing: Any, model: str) -> list[int]:
    """What each running worker of the model holds on its device, as it last reported."""
    held = []
    for w in listing.workers:
        if w.model != model or not w.pid:
            continue
        counter = MEMORY_COUNTER.get(w.device.kind or "cpu", "rss_bytes")
        value = int(w.memory.get(counter, 0))
        if value:
            held.append(value)
    return held
