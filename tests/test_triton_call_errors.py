"""A Triton python model's call to another model (BLS: `pb_utils.InferenceRequest(...).exec()`), in one
process on a fake of the worker's `models`: a failed call comes back as a response whose `has_error()` is
True and whose `error()` carries Triton's code and the message; an answered one has no error and its
outputs. Triton's BLS examples branch on `has_error()`, so it must tell the two apart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from mpsd.errors import ErrorCode
from mpsd.worker import calls
from mpsd.worker import triton_utils as pb_utils


class FakeModels:
    """The worker's `models`: `add_one` answers, any other model fails as the daemon would answer."""

    def infer(self, model: str, inputs: Mapping[str, Any], **options: Any) -> dict[str, Any]:
        if model != "add_one":
            raise calls.CallError(ErrorCode.INVALID_ARGUMENT, f"unexpected inference input for '{model}'")
        return {"y": np.asarray(inputs["x"]) + 1}

    def infer_async(self, model: str, inputs: Mapping[str, Any], **options: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            future.set_result(self.infer(model, inputs, **options))
        except calls.CallError as exc:
            future.set_exception(exc)
        return future


@pytest.fixture(autouse=True)
def models(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(calls, "_current", FakeModels())
    yield


def _request(model: str) -> pb_utils.InferenceRequest:
    x = pb_utils.Tensor("x", np.array([1.0, 2.0], np.float32))
    return pb_utils.InferenceRequest(model_name=model, inputs=[x], requested_output_names=["y"])


def test_an_answered_call_has_no_error_and_its_outputs() -> None:
    response = _request("add_one").exec()
    assert not response.has_error() and response.error() is None
    y = pb_utils.get_output_tensor_by_name(response, "y")
    assert y is not None and y.as_numpy().tolist() == [2.0, 3.0]


def test_a_failed_call_has_an_error_with_tritons_code_and_the_message() -> None:
    response = _request("missing").exec()
    assert response.has_error()
    error = response.error()
    assert error is not None and error.code() == pb_utils.TritonError.INVALID_ARG
    assert error.message() == "unexpected inference input for 'missing'"
    assert response.output_tensors() == []


def test_async_exec_tells_them_apart_too() -> None:
    async def both() -> tuple[Any, Any]:
        return await _request("add_one").async_exec(), await _request("missing").async_exec()

    answered, failed = asyncio.run(both())
    assert not answered.has_error() and failed.has_error()
    assert failed.error().code() == pb_utils.TritonError.INVALID_ARG
