"""The daemon's security settings: TLS files and access tokens (`tls:` and `auth:` in `config/mpsd.yaml`).

Secrets never sit in the config itself: a token is read from a file or an environment variable, so the
config can be shared, logged and committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mpsd.errors import ConfigError

Category = Literal["inference", "health", "model-repository", "logs-statistics"]
CATEGORIES: tuple[Category, ...] = ("inference", "health", "model-repository", "logs-statistics")


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TlsConfig(_Settings):
    """Serve over TLS; with `client_ca_file`, require a client certificate signed by that CA (mutual TLS)."""

    cert_file: Path = Field(description="PEM server certificate (chain), leaf first.")
    key_file: Path = Field(description="PEM private key of the server certificate.")
    client_ca_file: Path | None = Field(
        None, description="PEM CA bundle; when set, clients must present a certificate it signed."
    )

    def resolve(self, base: Path) -> None:
        """Make relative paths relative to the config file's directory."""
        self.cert_file = base / self.cert_file
        self.key_file = base / self.key_file
        if self.client_ca_file is not None:
            self.client_ca_file = base / self.client_ca_file

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA or None); ConfigError names the unreadable file."""
        ca = _read_file("tls.client_ca_file", self.client_ca_file) if self.client_ca_file else None
        return _read_file("tls.cert_file", self.cert_file), _read_file("tls.key_file", self.key_file), ca


class TokenConfig(_Settings):
    """One bearer token and the RPC categories it opens. The token comes from a file or the environment."""

    token_file: Path | None = Field(
        None, description="File holding the token (surrounding whitespace ignored)."
    )
    token_env: str | None = Field(None, description="Environment variable holding the token.")
    categories: Annotated[list[Category], Field(min_length=1)] = Field(
        description="What the token may call: inference, health, model-repository, logs-statistics."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_secret(cls, value: Any) -> Any:
        if isinstance(value, dict) and "token" in value:
            raise ValueError("tokens are not written in the config: use token_file or token_env")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TokenConfig:
        if (self.token_file is None) == (self.token_env is None):
            raise ValueError("give exactly one of token_file and token_env")
        return self

    @property
    def source(self) -> str:
        return (
            f"token_file {self.token_file}" if self.token_file is not None else f"token_env {self.token_env}"
        )

    def read(self) -> str:
        if self.token_file is not None:
            token = _read_file("auth.tokens.token_file", self.token_file).decode("utf-8", "replace").strip()
        else:
            assert self.token_env is not None
            if self.token_env not in os.environ:
                raise ConfigError(f"auth.tokens.token_env: environment variable {self.token_env} is not set")
            token = os.environ[self.token_env].strip()
        if not token:
            raise ConfigError(f"auth.tokens: {self.source} holds an empty token")
        return token


class AuthConfig(_Settings):
    """Bearer tokens (`authorization: Bearer <token>` metadata) and what each may call."""

    tokens: list[TokenConfig] = Field(
        [], description="When any token is listed, every RPC needs a token whose categories cover it."
    )
    open_categories: list[Category] = Field(
        [],
        description="Categories callable without a token even when tokens are configured, e.g. [health] "
        "for a load balancer's or service manager's probes.",
    )
    repository_changes_without_token: Literal["loopback", "allow", "refuse"] = Field(
        "loopback",
        description="With no tokens configured: whether RepositoryModelLoad/Unload and the admin Reload "
        "and Profile are accepted. loopback: only when listening on 127.0.0.1/::1/localhost or a Unix "
        "socket, or with mutual TLS; allow: always; refuse: never.",
    )

    def resolve(self, base: Path) -> None:
        for token in self.tokens:
            if token.token_file is not None:
                token.token_file = base / token.token_file


@dataclass(frozen=True)
class Token:
    """A token read from its source, with what it opens."""

    secret: bytes
    categories: frozenset[str]
    source: str
    group_readable_file: bool = False


def read_tokens(auth: AuthConfig) -> list[Token]:
    """Read every configured token now; ConfigError names the one that cannot be read."""
    tokens = []
    seen: dict[str, str] = {}
    for cfg in auth.tokens:
        secret = cfg.read()
        if secret in seen:
            raise ConfigError(f"auth.tokens: {cfg.source} holds the same token as {seen[secret]}")
        seen[secret] = cfg.source
        loose = False
        if cfg.token_file is not None:
            try:
                loose = bool(cfg.token_file.stat().st_mode & 0o077)
            except OSError as exc:  # removed right after it was read
                raise ConfigError(f"auth.tokens: cannot read {cfg.token_file}: {exc.strerror}") from None
        tokens.append(Token(secret.encode(), frozenset(cfg.categories), cfg.source, loose))
    return tokens


def _read_file(field: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from None
