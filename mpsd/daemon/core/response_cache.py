"""The response cache (Triton's `response_cache`): a request whose model version, inputs (names, types,
shapes and bytes) and requested outputs match an earlier one is answered with that one's outputs, without
running the model.

A model opts in (`response_cache: {enable: true}`); the cache is one LRU for the daemon, bounded in bytes
(`response_cache_bytes`). A key names the version by its fingerprint, so a reloaded version never answers
from its predecessor's entries, and those are dropped the first time the new one is seen. Requests with an
input or an output in shared memory are never cached, nor are decoupled models' responses.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable

from mpsd.daemon.dataplane.request import InferRequest, OutputTensor

Outputs = tuple[OutputTensor, ...]


def request_key(fingerprint: Hashable, request: InferRequest) -> bytes | None:
    """What identifies the request's answer (its parameters included: a python model reads them); None when
    it cannot be cached (data in shared memory)."""
    digest = hashlib.blake2b(digest_size=32)
    head = (fingerprint, request.model, request.outputs, request.batch_size, request.parameters)
    digest.update(repr(head).encode())
    for t in request.inputs:
        data = t.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return None  # read from a client's shared memory only when the batch is assembled
        digest.update(repr((t.name, t.datatype, t.shape, len(data))).encode())
        digest.update(data)
    return digest.digest()


class ResponseCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._entries: OrderedDict[bytes, tuple[str, Outputs, int]] = OrderedDict()
        self._fingerprints: dict[str, Hashable] = {}  # model version label -> the fingerprint seen last

    def get(self, key: bytes) -> Outputs | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, label: str, key: bytes, outputs: Outputs) -> None:
        if key in self._entries:  # two identical requests both missed: the second answer is a use too
            self._entries.move_to_end(key)
            return
        size = sum(len(o.data) for o in outputs) + len(key)
        if size > self.capacity:
            return
        self._entries[key] = (label, outputs, size)
        self.used += size
        while self.used > self.capacity:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.used -= dropped

    def seen(self, label: str, fingerprint: Hashable) -> None:
        """The version `label` now has `fingerprint`: entries of an earlier one are dropped."""
        previous = self._fingerprints.get(label)
        self._fingerprints[label] = fingerprint
        if previous is not None and previous != fingerprint:
            self.forget(label)

    def forget(self, label: str) -> None:
        for key in [k for k, (owner, _, _) in self._entries.items() if owner == label]:
            self.used -= self._entries.pop(key)[2]

    def __len__(self) -> int:
        return len(self._entries)
