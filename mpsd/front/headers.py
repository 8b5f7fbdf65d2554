"""The request keys a front has declared to the daemon, by id: a request whose key was declared goes with
its id and the spans of its pieces (`infer_wire.split_spans`), so the daemon finds its known header by
that id instead of walking the message and hashing its key on its one busy thread."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from mpsd.ipc.front_wire import Buffer, Kind, frame
from mpsd.ipc.infer_wire import split_spans

# Keys declared at once; past this many (ids that change each time, say) the table starts again, the
# daemon told so first.
MAX_DECLARED = 1024


class DeclaredHeaders:
    """Keys by id, each declared (a HEADER frame) on the link before the first call that names it: the link
    keeps frames in order, so the daemon always knows the id a call names."""

    def __init__(self, send: Callable[[tuple[Buffer, ...]], None]) -> None:
        self._send = send
        self._ids: dict[bytes, int] = {}
        self._next = itertools.count(1)

    def __len__(self) -> int:
        return len(self._ids)

    def spans(self, request: bytes) -> bytes | None:
        """The spans of the request behind its key's id (declared now if it is new); None when the
        request goes whole (`split_spans` has none for it)."""
        found = split_spans(request)
        if found is None:
            return None
        key, spans = found
        header_id = self._ids.get(key)
        if header_id is None:
            if len(self._ids) >= MAX_DECLARED:
                self._ids.clear()
                self._send(frame(Kind.FORGET_HEADERS))
            # ids wrap at 32 bits: a HEADER frame binds an id anew, before any call names it
            header_id = self._ids[key] = next(self._next) & 0xFFFFFFFF
            self._send(frame(Kind.HEADER, header_id, 0.0, key))
        return spans.pack(header_id)
