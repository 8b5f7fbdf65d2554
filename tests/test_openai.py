"""OpenAI's API over the repository's models, driven by the official `openai` Python client (sync and async,
streaming and not) against the real daemon and real models built here: an embeddings model with a real
tokenizer and a small BERT, a word model that streams one word per response (chat and completions), and a
transcription model that reads a WAV file. Each answer equals the same model's over the KServe protocol.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import openai_models, text_models
from tests.conftest import RunningDaemon, free_port, http_request, pending_requests, wait_for

SENTENCES = ["the lazy dog sleeps", "apple silicon serves pytorch models", "embeddings out", "zyzzyva", ""]
EMBED_BODY = """
while os.path.exists(self.config['parameters']['hold']):  # held while a test queues requests behind it
    time.sleep(0.01)
texts = inputs['TEXT'].reshape(-1)
return {'EMBEDDING': self.embed(texts), 'TOKENS': self.embed.tokens(texts).unsqueeze(1)}
"""
MESSAGES = [
    {"role": "system", "content": "you answer in words"},
    {"role": "user", "content": "the quick brown fox"},
]


@dataclass
class Served:
    daemon: RunningDaemon
    folder: Path  # the embeddings model's files
    log: Path  # the word models' log
    metrics: str
    sync: openai.OpenAI  # one client for the module, closed at its end

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return self.sync.with_options(**kwargs) if kwargs else self.sync

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://{self.daemon.http_address}/v1", api_key="unused")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("openai")
    repo, log = tmp / "repo", tmp / "words.log"
    folder = text_models.embedder(
        repo,
        "embedder",
        {
            "backend": "python",
            "max_batch_size": 8,
            "dynamic_batching": {"max_queue_delay_microseconds": 20_000},
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [
                {"name": "EMBEDDING", "data_type": "TYPE_FP32", "dims": [text_models.HIDDEN]},
                {"name": "TOKENS", "data_type": "TYPE_INT64", "dims": [1]},
            ],
            "instance_group": [{"kind": "KIND_CPU"}],
            "parameters": {"hold": str(tmp / "embed.hold")},
            "openai": {
                "task": "embeddings",
                "input": "TEXT",
                "output": "EMBEDDING",
                "usage_output": "TOKENS",
                "truncate_dimensions": True,
            },
        },
        EMBED_BODY,
    )
    openai_models.generator(repo, "chat", "chat", log)
    openai_models.generator(repo, "writer", "completions", log)
    openai_models.transcriber(repo, "transcriber")
    openai_models.byte_counts(repo, "plain", openai=False)
    openai_models.byte_counts(repo, "lazy", residency={"load": "on_demand"})
    openai_models.byte_counts(repo, "tally", residency={"load": "on_demand"})  # one test's own
    metrics = f"127.0.0.1:{free_port()}"
    settings = tmp / "mpsd.yaml"
    settings.write_text(f"metrics_address: {metrics}\n")
    daemon = RunningDaemon(repo, tmp / "daemon.log", config=settings)
    try:
        daemon.wait_ready(timeout=300)  # the embedder's worker imports transformers: seconds of CPU
        with openai.OpenAI(base_url=f"http://{daemon.http_address}/v1", api_key="unused") as client:
            yield Served(daemon, folder, log, metrics, client)
    finally:
        daemon.stop()
        daemon.kill_group()


def kserve_embeddings(served: Served, texts: list[str]) -> np.ndarray:
    client = httpclient.InferenceServerClient(served.daemon.http_address)
    tensor = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return client.infer("embedder", [tensor]).as_numpy("EMBEDDING")  # type: ignore[no-any-return]


def kserve_words(served: Served, model: str, text: str, params: dict[str, Any]) -> str:
    """The word model's text for the same input and request parameters over KServe's gRPC stream."""
    client = grpcclient.InferenceServerClient(served.daemon.address)
    got: list[Any] = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    tensor = grpcclient.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    client.async_stream_infer(model, [tensor], parameters=params, enable_empty_final_response=True)
    wait_for(lambda: got and got[-1][0] is not None and _final(got[-1][0]), 60, "the stream's end")
    client.stop_stream()
    client.close()
    assert all(error is None for _, error in got), got
    return "".join(r.as_numpy("TEXT_OUT")[0].decode() for r, _ in got[:-1])


def _final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def openai_requests(served: Served, model: str, endpoint: str, status: int) -> float:
    with urllib.request.urlopen(f"http://{served.metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    line = f'mpsd_openai_requests_total{{endpoint="{endpoint}",model="{model}",status="{status}"}}'
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))


# ---- models --------------------------------------------------------------------------------------------


def test_models_lists_the_models_that_opted_in_with_their_state(served: Served) -> None:
    client = served.client()
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"embedder", "chat", "writer", "transcriber", "lazy", "tally"}  # not "plain"
    assert listed["embedder"].owned_by == "mpsd" and listed["embedder"].object == "model"
    extra = listed["chat"].model_extra or {}
    assert extra["task"] == "chat" and extra["endpoint"] == "/v1/chat/completions"
    assert client.models.retrieve("transcriber").id == "transcriber"
    unnamed = openai_requests(served, "", "models", 404)
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("plain")
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # docs/observability.md: a request naming no model that serves the API is counted with `model` empty,
    # so that the names clients send make no new series
    assert openai_requests(served, "", "models", 404) == unnamed + 2
    assert openai_requests(served, "no-such-model", "models", 404) == 0
    assert openai_requests(served, "transcriber", "models", 200) >= 1


# ---- embeddings ----------------------------------------------------------------------------------------


def test_embeddings_equal_the_same_model_over_kserve_as_floats_and_base64(served: Served) -> None:
    client = served.client()
    expected = kserve_embeddings(served, SENTENCES)
    reference, tokens = text_models.reference(served.folder, SENTENCES)
    np.testing.assert_allclose(expected, reference, rtol=1e-4, atol=1e-5)
    floats = client.embeddings.create(model="embedder", input=SENTENCES, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(SENTENCES)))
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), expected, rtol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == int(tokens.sum())
    assert floats.model == "embedder"
    # the client asks for base64 unless told (little-endian float32), and decodes it itself
    decoded = client.embeddings.create(model="embedder", input=SENTENCES)
    np.testing.assert_array_equal(np.array([d.embedding for d in decoded.data], np.float32), expected)
    # a text alone and in a batch of five differ by rounding only (up to ~1e-7); another text's embedding
    # differs by far more than the tolerance
    assert min(np.abs(expected[i] - expected[j]).max() for i in range(5) for j in range(i)) > 1e-3
    raw = client.embeddings.with_raw_response.create(model="embedder", input="embeddings out")
    body = json.loads(raw.http_response.text)
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, expected[2], rtol=0, atol=1e-6)
    # more texts than the model batches (8): several calls at once, answered in the order of `input`
    many = client.embeddings.create(model="embedder", input=SENTENCES * 4, encoding_format="float")
    np.testing.assert_allclose(
        [d.embedding for d in many.data], np.tile(expected, (4, 1)), rtol=1e-4, atol=1e-5
    )
    assert many.usage.prompt_tokens == 4 * int(tokens.sum())
    one = client.embeddings.create(model="embedder", input="zyzzyva", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, expected[3], rtol=0, atol=1e-6)


def test_embeddings_of_concurrent_requests_are_batched(served: Served) -> None:
    """The model's first execution is held until all 16 requests are in the daemon: the others, queued
    behind it, run 8 (its max_batch_size) at a time, so 16 inferences take at most 3 executions."""
    stats = httpclient.InferenceServerClient(served.daemon.http_address)
    hold = served.log.parent / "embed.hold"

    def counts() -> tuple[int, int]:
        found = stats.get_inference_statistics("embedder")["model_stats"][0]
        return int(found.get("inference_count", 0)), int(found.get("execution_count", 0))

    async def many() -> list[Any]:
        client = served.async_client()
        async with client:
            return list(
                await asyncio.gather(
                    *(client.embeddings.create(model="embedder", input=SENTENCES[i % 5]) for i in range(16))
                )
            )

    before = counts()
    hold.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(asyncio.run, many())
            wait_for(lambda: pending_requests(served.metrics) == 16, 120, "16 requests in the daemon")
            hold.unlink()
            answers = running.result(timeout=120)
    finally:
        hold.unlink(missing_ok=True)
    after = counts()
    assert (after[0] - before[0], after[1] - before[1] <= 3) == (16, True), (before, after)
    expected = kserve_embeddings(served, SENTENCES)
    for i, answer in enumerate(answers):
        np.testing.assert_allclose(answer.data[0].embedding, expected[i % 5], rtol=1e-4, atol=1e-5)


def test_dimensions_cut_and_rescale_where_the_model_allows_it(served: Served) -> None:
    client = served.client()
    full = kserve_embeddings(served, ["the lazy dog sleeps"])[0]
    cut = client.embeddings.create(model="embedder", input="the lazy dog sleeps", dimensions=8)
    np.testing.assert_allclose(cut.data[0].embedding, full[:8] / np.linalg.norm(full[:8]), rtol=1e-5)
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="embedder", input="x", dimensions=text_models.HIDDEN + 1)
    assert raised.value.param == "dimensions" and "cannot give more" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:  # this model was not configured to be cut
        client.embeddings.create(model="lazy", input="x", dimensions=4)
    assert raised.value.param == "dimensions"


# ---- chat and completions -----------------------------------------------------------------------------


def test_chat_answers_equal_the_same_model_over_kserve_streamed_or_not(served: Served) -> None:
    client = served.client()
    params = {"max_tokens": 6, "seed": 3}
    expected = kserve_words(served, "chat", json.dumps(MESSAGES), params)
    assert len(expected.split()) == 6
    whole = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6, seed=3)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and whole.object == "chat.completion"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (8, 6)
    chunks = list(
        client.chat.completions.create(
            model="chat",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=6,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 6  # one chunk per response of the model
    ends = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert ends[-1] == "length" and not any(ends[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    other_seed = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6, seed=4)  # type: ignore[arg-type]
    assert other_seed.choices[0].message.content == kserve_words(
        served, "chat", json.dumps(MESSAGES), {"max_tokens": 6, "seed": 4}
    )


def test_stop_reaches_the_model_and_ends_the_answer(served: Served) -> None:
    client = served.client()
    free = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6).choices[0]  # type: ignore[arg-type]
    words = (free.message.content or "").split()
    stopped = client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=6, stop=[words[2]])  # type: ignore[arg-type]
    assert stopped.choices[0].finish_reason == "stop"
    assert (stopped.choices[0].message.content or "").split() == words[: words.index(words[2])]


def test_async_streaming_chat_and_completions(served: Served) -> None:
    async def run() -> tuple[str, str, str]:
        client = served.async_client()
        async with client:
            stream = await client.chat.completions.create(
                model="chat",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=5,
                stream=True,
            )
            chat = "".join([c.choices[0].delta.content or "" async for c in stream])
            stream2 = await client.completions.create(
                model="writer", prompt="a lazy dog", max_tokens=5, stream=True
            )
            streamed = "".join([c.choices[0].text async for c in stream2])
            whole = await client.completions.create(model="writer", prompt="a lazy dog", max_tokens=5)
            assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
            return chat, streamed, whole.choices[0].text

    chat, streamed, whole = asyncio.run(run())
    assert chat == kserve_words(served, "chat", json.dumps(MESSAGES), {"max_tokens": 5})
    assert streamed == whole == kserve_words(served, "writer", "a lazy dog", {"max_tokens": 5})
    echoed = served.client().completions.create(model="writer", prompt="a lazy dog", max_tokens=5, echo=True)
    assert echoed.choices[0].text == "a lazy dog" + whole


def test_a_client_that_goes_away_stops_the_model(served: Served) -> None:
    client = served.client()
    stream = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=100,
        stream=True,
        extra_body={"delay_ms": 100, "tag": "gone"},
    )
    first = [next(stream), next(stream)]  # the role, then the first word
    assert first[1].choices[0].delta.content
    stream.close()

    def lines() -> list[str]:
        return [line for line in served.log.read_text().splitlines() if line.startswith("gone ")]

    wait_for(lambda: "gone closed" in lines(), 30, "the model's generator closed")
    produced = [line for line in lines() if " produced " in line]
    assert len(produced) < 20, produced  # closed at its next response, far from the 100 asked for
    assert openai_requests(served, "chat", "chat.completions", 499) >= 1


def openai_events(served: Served, endpoint: str) -> list[dict[str, Any]]:
    """The daemon's `request` events of OpenAI requests to `endpoint`, oldest first."""
    events = []
    for line in served.daemon.log().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event", "").startswith("openai request") and event.get("endpoint") == endpoint:
            events.append(event)
    return events


def test_a_stream_that_fails_after_it_began_ends_with_an_error_and_counts_as_failed(served: Served) -> None:
    client = served.client()
    before = openai_requests(served, "chat", "chat.completions", 500)
    stream = client.chat.completions.create(
        model="chat",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=10,
        stream=True,
        extra_body={"fail_after": 2, "tag": "failing"},
    )
    pieces = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
    assert "failed on purpose after 2 words" in failed.value.message
    assert len([p for p in pieces if p]) == 2  # the words before the failure reached the client
    # answered with 200 (the stream had begun), counted and logged with the error's status
    assert openai_requests(served, "chat", "chat.completions", 500) == before + 1
    wait_for(
        lambda: any(
            e["event"] == "openai request failed" and e["status"] == 500 and "on purpose" in e["error"]
            for e in openai_events(served, "chat.completions")
        ),
        30,
        "the failed stream's event",
    )


def test_openai_requests_are_events_counted_per_model_and_endpoint(served: Served) -> None:
    """Each failed request is an event; the others are counted, one event per model and endpoint for each
    window (10 s) that had requests. `tally` is called by this test only: its windows (one, or two when
    the requests straddle a window's end) count its three requests, none failed."""
    client = served.client()
    seen = len(openai_events(served, "embeddings"))
    for _ in range(3):
        client.embeddings.create(model="tally", input="event", encoding_format="float")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nothing", input="x")

    def windows() -> list[dict[str, Any]]:
        return [
            e
            for e in openai_events(served, "embeddings")[seen:]
            if e["event"] == "openai requests" and e.get("model") == "tally"
        ]

    wait_for(lambda: sum(w["requests"] for w in windows()) == 3, 30, "the windows' events")
    for window in windows():
        assert window["failed"] == 0 and window["mean_ms"] > 0, window
        assert window["window_s"] == 10 and window["event_kind"] == "request", window
    refused = [e for e in openai_events(served, "embeddings")[seen:] if e["event"] == "openai request failed"]
    assert [e["status"] for e in refused] == [404], refused
    assert "`nothing` does not exist" in refused[0]["error"]


# ---- transcription ------------------------------------------------------------------------------------


def test_transcriptions_of_a_wav_file_in_each_format(served: Served, tmp_path: Path) -> None:
    client = served.client()
    audio = tmp_path / "tone.wav"
    audio.write_bytes(openai_models.tone_wav(440, 0.5))
    kserve = httpclient.InferenceServerClient(served.daemon.http_address)
    tensor = httpclient.InferInput("AUDIO", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([audio.read_bytes()], dtype=np.object_))
    expected = kserve.infer("transcriber", [tensor]).as_numpy("TEXT")[0].decode()
    assert expected == "a tone of 440 hertz lasting 0.50 seconds"
    with audio.open("rb") as file:
        assert client.audio.transcriptions.create(model="transcriber", file=file).text == expected
    with audio.open("rb") as file:
        text = client.audio.transcriptions.create(model="transcriber", file=file, response_format="text")
    assert text == expected
    with audio.open("rb") as file:
        verbose = client.audio.transcriptions.create(
            model="transcriber", file=file, response_format="verbose_json", language="en"
        )
    assert verbose.text == "[en] " + expected and verbose.language == "en" and verbose.duration == 0.5
    with audio.open("rb") as file:  # docs/openai.md: without a language, verbose_json's is "unknown"
        unsaid = client.audio.transcriptions.create(
            model="transcriber", file=file, response_format="verbose_json"
        )
    assert unsaid.language == "unknown"
    with audio.open("rb") as file, pytest.raises(openai.BadRequestError) as streamed:
        client.audio.transcriptions.create(model="transcriber", file=file, extra_body={"stream": "true"})
    assert streamed.value.body["param"] == "stream"  # type: ignore[index]
    with audio.open("rb") as file:
        srt = client.audio.transcriptions.create(model="transcriber", file=file, response_format="srt")
    assert srt == f"1\n00:00:00,000 --> 00:00:00,500\n{expected}\n\n"

    async def vtt() -> str:
        async with openai.AsyncOpenAI(
            base_url=f"http://{served.daemon.http_address}/v1", api_key="-"
        ) as aclient:
            return await aclient.audio.transcriptions.create(
                model="transcriber", file=("tone.wav", audio.read_bytes()), response_format="vtt"
            )

    assert asyncio.run(vtt()) == f"WEBVTT\n\n00:00:00.000 --> 00:00:00.500\n{expected}\n\n"


# ---- errors --------------------------------------------------------------------------------------------


def test_errors_in_openai_body_and_status(served: Served) -> None:
    client = served.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="nothing", input="x")
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert (
        unknown.value.type == "invalid_request_error" and "`nothing` does not exist" in unknown.value.message
    )
    with pytest.raises(openai.NotFoundError) as not_opted:
        client.embeddings.create(model="plain", input="x")
    assert "no `openai` section" in not_opted.value.message
    with pytest.raises(openai.BadRequestError) as wrong_task:
        client.embeddings.create(model="chat", input="x")
    assert wrong_task.value.param == "model" and "/v1/chat/completions" in wrong_task.value.message
    with pytest.raises(openai.BadRequestError) as tokens:
        client.embeddings.create(model="embedder", input=[[1, 2, 3]])
    assert tokens.value.param == "input" and "openai.tokens" in tokens.value.message
    with pytest.raises(openai.BadRequestError) as unknown_field:
        client.embeddings.create(model="embedder", input="x", extra_body={"colour": "red"})
    assert unknown_field.value.param == "colour" and "openai.parameters" in unknown_field.value.message
    with pytest.raises(openai.BadRequestError) as messages:
        client.chat.completions.create(model="chat", messages=[])
    assert messages.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model="chat", messages=MESSAGES, n=2)  # type: ignore[arg-type]
    assert n.value.param == "n"
    # the whole body, as OpenAI writes it, and KServe's routes still answer in Triton's
    address = served.daemon.http_address
    status, body, _ = http_request(address, "POST", "/v1/embeddings", b"[1]")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body, _ = http_request(address, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "unknown_url"
    status, body, _ = http_request(address, "GET", "/v2/models/nothing")
    assert status == 404 and isinstance(body["error"], str)


def test_a_body_over_the_limit_is_refused_before_it_is_read(served: Served) -> None:
    import http.client

    host, _, port = served.daemon.http_address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:  # declares 1 GiB and sends nothing: the answer comes from the declared length alone
        connection.putrequest("POST", "/v1/embeddings")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(2**30))
        connection.endheaders()
        response = connection.getresponse()
        body = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 413 and "max_message_bytes" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


# ---- load on demand, metrics ---------------------------------------------------------------------------


def test_a_model_not_loaded_loads_on_its_first_embeddings_request(served: Served) -> None:
    client = served.client()
    state = (client.models.retrieve("lazy").model_extra or {})["state"]
    assert state == "UNLOADED"
    before = openai_requests(served, "lazy", "embeddings", 200)
    answer = client.embeddings.create(model="lazy", input=["abc", "hh"], encoding_format="float")
    assert answer.data[0].embedding == [0, 1, 1, 1, 0, 0, 0, 0]  # 'a' 97, 'b' 98, 'c' 99 modulo 8
    assert answer.data[1].embedding == [2, 0, 0, 0, 0, 0, 0, 0]  # 'h' 104
    assert (client.models.retrieve("lazy").model_extra or {})["state"] == "READY"
    assert openai_requests(served, "lazy", "embeddings", 200) == before + 1


# ---- access, a port of its own, the memory budget ------------------------------------------------------

INFER_TOKEN, READER_TOKEN = "openai-infer-token", "openai-reader-token"


@dataclass
class Guarded:
    daemon: RunningDaemon
    url: str  # OpenAI's API, on its own port
    sync: openai.OpenAI

    def client(self, key: str) -> openai.OpenAI:
        return self.sync.with_options(api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    tmp = tmp_path_factory.mktemp("guarded")
    repo = tmp / "repo"
    openai_models.byte_counts(repo, "bytes")
    openai_models.byte_counts(repo, "huge", residency={"load": "on_demand", "footprint_bytes": 10**15})
    for name, token in (("infer.token", INFER_TOKEN), ("reader.token", READER_TOKEN)):
        (tmp / name).write_text(token)
        (tmp / name).chmod(0o600)
    own = f"127.0.0.1:{free_port()}"
    settings = tmp / "mpsd.yaml"
    settings.write_text(
        json.dumps(
            {
                "openai_address": own,
                "auth": {
                    "tokens": [
                        {"token_file": "infer.token", "categories": ["inference"]},
                        {"token_file": "reader.token", "categories": ["health"]},
                    ],
                    "open_categories": ["health"],
                },
            }
        )
    )
    daemon = RunningDaemon(repo, tmp / "daemon.log", config=settings)
    try:
        daemon.wait_ready()
        with openai.OpenAI(base_url=f"http://{own}/v1", api_key="-") as client:
            yield Guarded(daemon, f"http://{own}/v1", client)
    finally:
        daemon.stop()
        daemon.kill_group()


def test_tokens_decide_openai_requests_as_any_other(guarded: Guarded) -> None:
    with pytest.raises(openai.AuthenticationError) as missing:
        guarded.client("not-a-token").embeddings.create(model="bytes", input="abc")
    assert missing.value.code == "invalid_api_key" and "not valid" in missing.value.message
    with pytest.raises(openai.PermissionDeniedError) as reader:
        guarded.client(READER_TOKEN).models.list()
    assert "needs category 'inference'" in reader.value.message
    client = guarded.client(INFER_TOKEN)
    assert {m.id for m in client.models.list()} == {"bytes", "huge"}
    answer = client.embeddings.create(model="bytes", input="abc", encoding_format="float")
    assert answer.data[0].embedding == [0, 1, 1, 1, 0, 0, 0, 0]


def test_on_a_port_of_its_own_openai_is_served_there_only(guarded: Guarded) -> None:
    own = guarded.url.removeprefix("http://").removesuffix("/v1")
    status, body, _ = http_request(own, "GET", "/v2/health/ready")
    assert status == 404 and body["error"]["code"] == "unknown_url"  # KServe's routes are not here
    status, body, _ = http_request(guarded.daemon.http_address, "GET", "/v1/models")
    assert status == 404 and isinstance(body["error"], str)  # nor OpenAI's on the KServe port


def test_a_model_that_cannot_fit_the_memory_budget_is_429(guarded: Guarded) -> None:
    with pytest.raises(openai.RateLimitError) as raised:
        guarded.client(INFER_TOKEN).embeddings.create(model="huge", input="abc")
    assert raised.value.code == "rate_limit_exceeded" and "huge" in raised.value.message


# ---- the config section --------------------------------------------------------------------------------


def _config(openai_section: dict[str, Any], **extra: Any) -> dict[str, Any]:
    string = {"data_type": "TYPE_STRING", "dims": [1]}
    return {
        "backend": "python",
        "max_batch_size": 4,
        "input": [{"name": "TEXT", **string}],
        "output": [
            {"name": "VECTOR", "data_type": "TYPE_FP32", "dims": [8]},
            {"name": "WORDS", **string},
        ],
        "openai": openai_section,
        **extra,
    }


EMBEDDINGS = {"task": "embeddings", "input": "TEXT", "output": "VECTOR"}


@pytest.mark.parametrize(
    ("section", "extra", "field", "words"),
    [
        ({**EMBEDDINGS, "input": "NOPE"}, {}, "openai.input", "no input 'NOPE'"),
        ({**EMBEDDINGS, "output": "WORDS"}, {}, "openai.output", "must be TYPE_FP16 or TYPE_BF16"),
        ({**EMBEDDINGS, "task": "chat"}, {}, "openai.output", "must be TYPE_STRING"),
        (
            EMBEDDINGS,
            {"input": [{"name": "TEXT", **openai_models.STRING}, {"name": "PARAMS", **openai_models.STRING}]},
            "openai",
            "more inputs: PARAMS",
        ),
        ({**EMBEDDINGS, "usage_output": "WORDS"}, {}, "openai.usage_output", "TYPE_INT32"),
        ({**EMBEDDINGS, "finish_reason_output": "WORDS"}, {}, "openai.finish_reason_output", "for chat"),
        (
            {**EMBEDDINGS, "task": "chat", "output": "WORDS", "tokens": True},
            {},
            "openai.tokens",
            "for embeddings",
        ),
        (
            EMBEDDINGS,
            {"max_batch_size": 0, "model_transaction_policy": {"decoupled": True}},
            "openai.task",
            "decoupled",
        ),
    ],
)
def test_the_openai_section_names_inputs_and_outputs_it_can_use(
    section: dict[str, Any], extra: dict[str, Any], field: str, words: str
) -> None:
    from pydantic import ValidationError

    from mpsd.config.model_config import ModelConfig, error_loc

    with pytest.raises(ValidationError) as raised:
        ModelConfig.model_validate(_config(section, **extra))
    error = raised.value.errors()[0]
    assert ".".join(str(p) for p in error_loc(error)) == field
    assert words in error["msg"], error["msg"]


def test_an_embeddings_model_without_batching_may_take_all_texts_at_once() -> None:
    from mpsd.config.model_config import ModelConfig

    config = _config(EMBEDDINGS, max_batch_size=0)
    config["input"] = [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [-1]}]
    config["output"][0]["dims"] = [-1, 8]
    assert ModelConfig.model_validate(config).openai is not None
    config["max_batch_size"] = 4
    with pytest.raises(ValueError, match=r"openai.input 'TEXT' dims must be \[1\]"):
        ModelConfig.model_validate(config)
