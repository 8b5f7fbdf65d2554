"""The response cache through the pipeline in one process (api/pipeline.py and core/response_cache.py, through
`Operations` over a fake registry whose versions have fake data planes): a repeated request is answered
without reaching the model's plane (the version's cache_hit counts it), a changed byte or other requested
outputs are not, a model without `response_cache` never is, and a reloaded version does not answer from
its predecessor's entries. The cache's own bounds are test_response_cache_bounds.py's; a repeated request
over gRPC and HTTP answered from the cache is test_infer.py's."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.config.model_file import validate_model_config
from mpsd.daemon.api.call import InferCall, InputCall, OutputCall
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.core.response_cache import ResponseCache, request_key
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from tests.test_pipeline import Registry, Version


def _config(cache: bool) -> dict[str, Any]:
    f = {"data_type": "TYPE_FP32", "dims": [-1]}
    return {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "x", **f}],
        "output": [{"name": "y", **f}, {"name": "z", **f}],
        "response_cache": {"enable": cache},
    }


class Cached:
    """Operations over `cached` and `plain`, with one response cache."""

    def __init__(self) -> None:
        self.cache = ResponseCache(16 << 20)
        self.cached = Version("cached", 1, ModelConfig.model_validate(_config(True)), fingerprint=("a", "1"))
        self.plain = Version("plain", 1, ModelConfig.model_validate(_config(False)))
        self.registry = Registry(self.cached, self.plain)
        self.ops = Operations(cast(Any, self.registry), lambda: False, response_cache=self.cache)

    def infer(self, model: str, x: np.ndarray, outputs: tuple[str, ...] = ("y", "z")) -> list[bytes]:
        call = InferCall(
            model,
            "",
            "r",
            {},
            (InputCall("x", "FP32", x.shape),),
            tuple(OutputCall(o) for o in outputs),
            (x.tobytes(),),
        )
        return [bytes(o.data) for o in asyncio.run(self.ops.infer(call)).result.outputs]

    def runs(self, model: str) -> int:
        return len(self.registry.served[model][1].plane.seen)


def test_a_repeated_request_is_answered_from_the_cache() -> None:
    c = Cached()
    x = np.arange(6, dtype=np.float32)
    first = c.infer("cached", x)
    assert c.runs("cached") == 1 and c.cached.stats.cache_miss.count == 1
    assert c.infer("cached", x) == first == c.infer("cached", x.copy())
    assert (
        c.runs("cached") == 1 and c.cached.stats.cache_hit.count == 2 and c.cached.stats.cache_miss.count == 1
    )


def test_a_repeated_large_request_is_answered_from_the_cache() -> None:
    """Inputs large enough to be hashed beside the event loop (a MiB) make the same key."""
    c = Cached()
    x = np.ones(1 << 18, dtype=np.float32)
    c.infer("cached", x)
    c.infer("cached", x)
    assert c.runs("cached") == 1 and c.cached.stats.cache_hit.count == 1


def test_a_changed_byte_or_other_outputs_run_the_model() -> None:
    c = Cached()
    x = np.full(4, 7.0, dtype=np.float32)
    c.infer("cached", x)
    changed = x.copy()
    changed.view(np.uint8)[0] ^= 1
    (y,) = c.infer("cached", changed, ("y",))
    assert y == changed.tobytes()  # the fake plane answers its input
    c.infer("cached", x, ("z",))
    assert c.runs("cached") == 3 and c.cached.stats.cache_hit.count == 0


def test_a_model_without_the_cache_runs_every_time() -> None:
    c = Cached()
    x = np.ones(3, dtype=np.float32)
    for _ in range(3):
        c.infer("plain", x)
    assert c.runs("plain") == 3 and len(c.cache) == 0
    assert (c.plain.stats.cache_hit.count, c.plain.stats.cache_miss.count) == (0, 0)


def test_a_reloaded_version_does_not_answer_from_its_predecessors_entries() -> None:
    c = Cached()
    x = np.full(2, 3.0, dtype=np.float32)
    c.infer("cached", x, ("y",))
    reloaded = Version("cached", 1, c.cached.config, fingerprint=("a", "2"))  # same label, new files
    c.registry.add(reloaded)
    c.infer("cached", x, ("y",))
    assert len(reloaded.plane.seen) == 1 and reloaded.stats.cache_hit.count == 0
    assert len(c.cache) == 1  # the predecessor's entry went once the new version was seen


def test_a_decoupled_model_cannot_enable_the_cache(tmp_path: Path) -> None:
    config = {**_config(True), "model_transaction_policy": {"decoupled": True}}
    with pytest.raises(ValueError) as info:
        validate_model_config(tmp_path / "config.yaml", config)
    assert "a decoupled model's responses are a stream, which the response cache does not keep" in str(
        info.value
    )


def test_a_request_with_other_parameters_has_another_key() -> None:
    """A python model reads its request's parameters: they are part of what identifies the answer."""
    plain = InferRequest("m", "", "", (InputTensor("x", "FP32", (1,), bytes(4)),), ("y",))
    assert request_key(1, plain) == request_key(1, replace(plain, id="other"))
    assert request_key(1, plain) != request_key(1, replace(plain, parameters=(("k", 1),)))
    assert request_key(1, replace(plain, parameters=(("k", 1),))) != request_key(
        1, replace(plain, parameters=(("k", "1"),))
    )
