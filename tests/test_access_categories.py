"""Each RPC's access category is the one docs/security.md's table gives it, and a token for any other
category is refused it (PERMISSION_DENIED), checked for every RPC the table names, in one process
(net/auth.py's AccessPolicy)."""

from __future__ import annotations

import re

import pytest

from mpsd.config.security import Token
from mpsd.errors import PermissionDenied
from mpsd.net.auth import AccessPolicy, category_of
from tests.conftest import ROOT

KSERVE = "/inference.GRPCInferenceService/"
ADMIN = "/mpsd.v1.MpsdAdmin/"
CATEGORIES = ("inference", "health", "model-repository", "logs-statistics")
ADMIN_RPCS = {"StreamLogs", "ListWorkers", "Reload", "Profile"}
SHARED_MEMORY_RPCS = [
    f"{kind}SharedMemory{what}"
    for kind in ("System", "Cuda")
    for what in ("Status", "Register", "Unregister")
]


def _documented() -> dict[str, str]:
    """Full method name -> category, from the table in docs/security.md (the RPCs it names in backticks)."""
    table: dict[str, str] = {}
    for line in (ROOT / "docs" / "security.md").read_text().splitlines():
        row = re.fullmatch(r"\| `([a-z-]+)` \| (.*) \|", line)
        if row is None or row.group(1) not in CATEGORIES:
            continue
        names = re.findall(r"`(\w+)`", row.group(2))
        if "the system and CUDA shared-memory RPCs" in row.group(2):
            names += SHARED_MEMORY_RPCS
        for name in names:
            table[(ADMIN if name in ADMIN_RPCS else KSERVE) + name] = row.group(1)
    return table


DOCUMENTED = _documented()


def test_the_table_names_every_category_and_trace_setting() -> None:
    assert set(DOCUMENTED.values()) == set(CATEGORIES)
    assert DOCUMENTED[KSERVE + "TraceSetting"] == "logs-statistics"
    assert len(DOCUMENTED) == 24, DOCUMENTED


@pytest.mark.parametrize("method", sorted(DOCUMENTED), ids=lambda m: m.rsplit("/", 1)[-1])
def test_each_rpc_needs_its_documented_category_and_no_other(method: str) -> None:
    category = DOCUMENTED[method]
    assert category_of(method) == category
    tokens = [Token(c.encode(), frozenset({c}), f"env {c}") for c in CATEGORIES]
    policy = AccessPolicy(tokens)
    for other in CATEGORIES:
        refusal = policy.check(method, [("authorization", f"Bearer {other}")])
        if other == category:
            assert refusal is None, refusal
        else:
            assert isinstance(refusal, PermissionDenied), (other, refusal)
            assert f"needs category '{category}'" in refusal.message
            assert refusal.message.endswith(f"this token allows: {other}")  # docs/security.md: what it opens
