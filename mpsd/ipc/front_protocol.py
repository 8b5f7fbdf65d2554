"""What the daemon and a front tell each other besides ModelInfer: the CONFIG, AUTH and READY frames.

Each is a frozen dataclass that one end encodes and the other decodes, so neither reads a dict by key. The
bytes are JSON (sent once per start or reload, not per call). `decode` checks every field's type and
refuses missing or unknown fields: a payload the two ends disagree on fails with a message that names the
frame and the field, instead of a KeyError somewhere in the front. The access settings travel as plain
data (the auth settings as JSON, the tokens and TLS material as `mpsd.net` exports them); turning them
back into objects is the front's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpsd.errors import Internal

# What a front calls itself in ps once it has its settings; the daemon tells fronts from workers by it.
FRONT_TITLE = "mpsd: front "


class MalformedMessage(Internal):
    """A CONFIG, AUTH or READY payload that does not have the fields its kind promises."""


Exported = dict[str, Any]  # a JSON object as one end exports it (AuthConfig, a token, TLS material)


@dataclass(frozen=True)
class ArenaRegion:
    """The shared-memory arena the daemon created for one front (`front_arena`)."""

    name: str
    size: int


@dataclass(frozen=True)
class FrontAccess:
    """What SIGHUP can change, as a front reads it at start (in CONFIG) and on a reload (AUTH)."""

    auth: Exported  # AuthConfig as JSON
    tokens: tuple[Exported, ...] = field(repr=False)  # `mpsd.net.auth.export_tokens`: secrets
    tls: dict[str, str | None] | None = field(repr=False)  # `TlsMaterial.export`: a private key

    def fields(self) -> dict[str, Any]:
        return {"auth": self.auth, "tokens": list(self.tokens), "tls": self.tls}

    def encode(self) -> bytes:
        return json.dumps(self.fields()).encode()

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> FrontAccess:
        """An AUTH payload; MalformedMessage when it is not one."""
        fields = _Fields(_load(payload, "AUTH"), "AUTH")
        access = cls.read(fields)
        fields.done()
        return access

    @classmethod
    def read(cls, fields: _Fields) -> FrontAccess:
        tokens = fields.take("tokens", list)
        tls = fields.take("tls", dict, type(None))
        return cls(
            fields.take("auth", dict),
            tuple(_token(t, fields.frame, f"tokens[{i}]") for i, t in enumerate(tokens)),
            _tls(tls, fields.frame) if tls is not None else None,
        )


@dataclass(frozen=True)
class FrontConfig:
    """The first frame a front gets: which front it is, what to serve and how, where the daemon is."""

    index: int
    log_level: str  # the daemon's level now: LogSettings or SIGHUP may have changed the configured one
    daemon_target: str  # the daemon's gRPC server, for every call but ModelInfer
    config: Exported  # DaemonConfig as JSON
    arena: ArenaRegion | None  # None: large calls take the socket too
    access: FrontAccess
    address: str  # where to listen: grpc_address, or grpc_address's host with a port of this front's own
    share_port: bool  # SO_REUSEPORT: the port is grpc_address's, shared with the other fronts

    def encode(self) -> bytes:
        arena = {"name": self.arena.name, "size": self.arena.size} if self.arena is not None else None
        settings = {
            "index": self.index,
            "log_level": self.log_level,
            "daemon_target": self.daemon_target,
            "config": self.config,
            "arena": arena,
            **self.access.fields(),
            "address": self.address,
            "share_port": self.share_port,
        }
        return json.dumps(settings).encode()

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> FrontConfig:
        """A CONFIG payload; MalformedMessage when it is not one."""
        fields = _Fields(_load(payload, "CONFIG"), "CONFIG")
        arena = fields.take("arena", dict, type(None))
        if arena is not None:
            where = _Fields(arena, "CONFIG", "arena")
            arena = ArenaRegion(where.take("name", str), where.take("size", int))
            where.done()
        config = cls(
            fields.take("index", int),
            fields.take("log_level", str),
            fields.take("daemon_target", str),
            fields.take("config", dict),
            arena,
            FrontAccess.read(fields),
            fields.take("address", str),
            fields.take("share_port", bool),
        )
        fields.done()
        return config


@dataclass(frozen=True)
class FrontReady:
    """A front listens: the daemon logs which process, which event loop, its busy-poll budget and the
    objects it froze."""

    pid: int
    event_loop: str
    busy_poll_us: int = 0
    frozen_objects: int = 0  # what its start-up made, frozen out of the collector's scans (`mpsd.heap`)

    def encode(self) -> bytes:
        fields = {
            "pid": self.pid,
            "event_loop": self.event_loop,
            "busy_poll_us": self.busy_poll_us,
            "frozen_objects": self.frozen_objects,
        }
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, payload: bytes | bytearray) -> FrontReady:
        """A READY payload; MalformedMessage when it is not one."""
        fields = _Fields(_load(payload, "READY"), "READY")
        ready = cls(
            fields.take("pid", int),
            fields.take("event_loop", str),
            fields.take("busy_poll_us", int),
            fields.take("frozen_objects", int),
        )
        fields.done()
        return ready


def _load(payload: bytes | bytearray, what: str) -> object:
    try:
        return json.loads(payload)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError both are
        raise MalformedMessage(f"malformed {what} frame: not JSON ({exc})") from None


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


class _Fields:
    """One JSON object of a frame (the frame's own, or one inside it at `path`), read field by field,
    each checked for its type."""

    def __init__(self, data: object, frame: str, path: str = "") -> None:
        self.frame, self.path = frame, path
        if not isinstance(data, dict):
            raise self.error(f"{path or 'the payload'} must be an object, not {_kind(data)}")
        self.data: Mapping[str, object] = data
        self._read: set[str] = set()

    def error(self, problem: str) -> MalformedMessage:
        return MalformedMessage(f"malformed {self.frame} frame: {problem}")

    def where(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, *types: type) -> Any:
        if key not in self.data:
            raise self.error(f"no '{self.where(key)}'")
        value = self.data[key]
        # JSON true and false are Python bools, which are ints too: they never pass for a number.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = " or ".join(_kind(None) if t is type(None) else t.__name__ for t in types)
            raise self.error(f"'{self.where(key)}' must be {expected}, not {_kind(value)}")
        self._read.add(key)
        return value

    def done(self) -> None:
        """Refuse fields nobody reads: the two ends would disagree on what was said."""
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise self.error(f"unknown field(s) {', '.join(repr(self.where(k)) for k in unknown)}")


def _token(data: object, frame: str, path: str) -> Exported:
    fields = _Fields(data, frame, path)
    secret = fields.take("secret", str)
    categories = fields.take("categories", list)
    if not all(isinstance(c, str) for c in categories):
        raise fields.error(f"'{fields.where('categories')}' must be a list of str")
    token = {"secret": secret, "categories": categories, "source": fields.take("source", str)}
    fields.done()
    return token


def _tls(data: object, frame: str) -> dict[str, str | None]:
    fields = _Fields(data, frame, "tls")
    tls = {
        "chain": fields.take("chain", str),
        "key": fields.take("key", str),
        "client_ca": fields.take("client_ca", str, type(None)),
    }
    fields.done()
    return tls
