"""Who may call what: bearer tokens with per-category access, checked where a call's method is looked up.

Every RPC belongs to one category (Triton's restricted-protocol idea, in four groups). With tokens
configured, a call needs `authorization: Bearer <token>` metadata naming a token whose categories cover
the RPC: no or an unknown token is UNAUTHENTICATED, a token without the category PERMISSION_DENIED.
Without tokens, everything is open except the RPCs that change what is loaded, which follow
`auth.repository_changes_without_token`.

A refused call is answered before its request is even decoded.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import structlog

from mpsd.config.security import AuthConfig, Category, Token, read_tokens
from mpsd.errors import MpsdError, PermissionDenied, Unauthenticated
from mpsd.net.status import grpc_status

log = structlog.get_logger("mpsd.net.auth")

_KSERVE = "/inference.GRPCInferenceService/"
_ADMIN = "/mpsd.v1.MpsdAdmin/"
# OpenAI's API (HTTP only): its endpoints, named as methods so that tokens decide them as any other.
OPENAI = "/openai.v1.OpenAI/"
OPENAI_METHODS = ("ListModels", "Embeddings", "ChatCompletions", "Completions", "Transcriptions")

METHOD_CATEGORY: dict[str, Category] = {
    **{
        _KSERVE + m: "inference"
        for m in (
            "ModelInfer",
            "ModelStreamInfer",
            "SystemSharedMemoryStatus",
            "SystemSharedMemoryRegister",
            "SystemSharedMemoryUnregister",
            "CudaSharedMemoryStatus",
            "CudaSharedMemoryRegister",
            "CudaSharedMemoryUnregister",
        )
    },
    **{
        _KSERVE + m: "health"
        for m in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig")
    },
    **{
        _KSERVE + m: "model-repository"
        for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
    },
    **{_KSERVE + m: "logs-statistics" for m in ("ModelStatistics", "LogSettings", "TraceSetting")},
    _ADMIN + "StreamLogs": "logs-statistics",
    _ADMIN + "ListWorkers": "logs-statistics",
    _ADMIN + "Reload": "model-repository",
    # An operator's tool: it slows the profiled worker and shows the model's operators and shapes.
    _ADMIN + "Profile": "model-repository",
    # Listing the models is part of using them: an OpenAI client lists with the key it infers with.
    **{OPENAI + m: "inference" for m in OPENAI_METHODS},
}
# Whole services whose every method is in one category.
SERVICE_CATEGORY: dict[str, Category] = {
    "/grpc.health.v1.Health/": "health",
    "/grpc.reflection.v1alpha.ServerReflection/": "health",
    "/grpc.reflection.v1.ServerReflection/": "health",
}
# What changes the set of loaded models; without tokens these follow repository_changes_without_token.
REPOSITORY_CHANGES = frozenset(
    {_KSERVE + "RepositoryModelLoad", _KSERVE + "RepositoryModelUnload", _ADMIN + "Reload"}
)
# Without tokens, the operator RPCs follow the same policy as the repository changes.
OPERATOR_ONLY = REPOSITORY_CHANGES | {_ADMIN + "Profile"}

Metadata = Sequence[tuple[str, str | bytes]]


def category_of(method: str) -> Category | None:
    """The access category of a full method name (`/package.Service/Method`), None when unknown."""
    found = METHOD_CATEGORY.get(method)
    if found is not None:
        return found
    for prefix, category in SERVICE_CATEGORY.items():
        if method.startswith(prefix):
            return category
    return None


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1] or method


def _bearer(metadata: Metadata | None) -> bytes | None:
    """The token of the first `authorization: Bearer ...` entry, None when there is none."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value if isinstance(value, str) else value.decode("latin-1")
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip().encode("utf-8", "surrogateescape")
        return None
    return None


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class AccessPolicy:
    """Decides one call from its method name and metadata; pure logic, no gRPC objects."""

    def __init__(
        self,
        tokens: Sequence[Token],
        open_categories: Sequence[Category] = (),
        repository_changes: str = "loopback",
        local_only: bool = True,
        mutual_tls: bool = False,
        address: str = "",
    ) -> None:
        # Digests have one length, so compare_digest takes the same time whatever the client sends.
        self._tokens = [(_digest(t.secret), t) for t in tokens]
        self._open = frozenset(open_categories)
        self._repository_changes = repository_changes
        self._local_only = local_only
        self._mutual_tls = mutual_tls
        self._address = address

    @property
    def uses_tokens(self) -> bool:
        return bool(self._tokens)

    def check(self, method: str, metadata: Metadata | None) -> MpsdError | None:
        """None when the call may go ahead, else the error to answer it with."""
        category = category_of(method)
        if not self._tokens:
            return self._check_without_tokens(method)
        if category is not None and category in self._open:
            return None
        given = _bearer(metadata)
        where = f"{_short(method)} (category '{category}')" if category else _short(method)
        if given is None:
            return Unauthenticated(
                f"{where} needs a token: send the metadata 'authorization: Bearer <token>'"
            )
        token = self._match(given)
        if token is None:
            return Unauthenticated(f"{where}: the bearer token is not valid")
        if category is None:
            return PermissionDenied(f"{_short(method)} belongs to no access category; no token opens it")
        if category not in token.categories:
            allowed = ", ".join(sorted(token.categories))
            return PermissionDenied(
                f"{_short(method)} needs category '{category}'; this token allows: {allowed}"
            )
        return None

    def _match(self, given: bytes) -> Token | None:
        digest = _digest(given)
        found = None
        for secret, token in self._tokens:  # no early exit: every token is compared
            if hmac.compare_digest(digest, secret):
                found = token
        return found

    def _check_without_tokens(self, method: str) -> MpsdError | None:
        if method not in OPERATOR_ONLY:
            return None
        policy = self._repository_changes
        if policy == "allow":
            return None
        if policy == "loopback" and (self._local_only or self._mutual_tls):
            return None
        why = (
            "auth.repository_changes_without_token is 'refuse'"
            if policy == "refuse"
            else f"the daemon listens on {self._address}, which other hosts can reach, and no auth tokens "
            "are configured"
        )
        return PermissionDenied(
            f"{_short(method)} is switched off: {why}. To enable it, configure auth.tokens with the "
            "'model-repository' category, or use mutual TLS (tls.client_ca_file), or set "
            "auth.repository_changes_without_token: allow"
        )


def build_policy(
    auth: AuthConfig,
    local_only: bool,
    mutual_tls: bool,
    address: str,
    tokens: Sequence[Token] | None = None,
) -> AccessPolicy:
    """The policy for `tokens`, or for the configured tokens read now (ConfigError if one cannot be)."""
    if tokens is None:
        tokens = read_tokens(auth)
    for token in tokens:
        if token.group_readable_file:
            log.warning("token file is readable by other users; chmod 600 it", source=token.source)
    return AccessPolicy(
        tokens, auth.open_categories, auth.repository_changes_without_token, local_only, mutual_tls, address
    )


def refusal(error: MpsdError) -> grpc.RpcMethodHandler:
    """A handler that answers with the error without reading the request (any call shape accepts it)."""

    async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc_status(error), error.message)

    return grpc.stream_unary_rpc_method_handler(refuse)


def export_tokens(tokens: Sequence[Token]) -> list[dict[str, object]]:
    """Tokens as JSON for a front process, over its private socketpair: the daemon reads the token files
    once, and every front checks calls against exactly the tokens the daemon has."""
    return [
        {"secret": t.secret.decode(), "categories": sorted(t.categories), "source": t.source} for t in tokens
    ]


def import_tokens(exported: Sequence[Mapping[str, Any]]) -> list[Token]:
    return [Token(str(t["secret"]).encode(), frozenset(t["categories"]), str(t["source"])) for t in exported]
