"""One model's trouble stays that model's: the one place where whatever a model's own work raises becomes
that model's state.

The work done for one model (reading and placing its config on this host's devices, admitting it under the
memory budget, starting and warming up its workers, rolling a change out over its running versions) can fail
in ways no list of checks foresees: a rule that depends on the devices a host has, a field no earlier check
read. Every entry point that does such work (a reconcile's step for the model, which serves the start, a
hot reload and RepositoryModelLoad alike, and a load on demand) runs it inside `contained`. Whatever is
raised there is recorded on the model's entry (UNAVAILABLE with the reason in the index, `mpsd status`, the
events and health; versions that already run keep serving) and goes on as a LoadError, so the daemon and
every other model are never reached by it. Cancellation is the daemon's, not the model's: it passes through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import structlog

from mpsd.daemon.core.rollout import ModelEntry
from mpsd.errors import LoadError, MpsdError, ResourceExhausted

log = structlog.get_logger("mpsd.daemon.core.registry")


def reason_of(exc: Exception) -> str:
    """What the operator reads: an error of the taxonomy says it itself; anything else is named by type,
    since it is a fault in mpsd that the model's config met, not a message written for anyone."""
    if isinstance(exc, MpsdError):
        return exc.message
    return f"internal error: {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def contained(entry: ModelEntry, fingerprint: str) -> Iterator[None]:
    """Run one piece of the model's work: any exception becomes the model's state and a LoadError.

    ResourceExhausted (no room under the memory budget now) is not a failure of this source: room may be
    made later, so the same files load then. A model that must run keeps it as its reason; one that loads on
    demand stays cold (it tries again at its next request). It goes on as it is, so a request that asked
    for the load hears RESOURCE_EXHAUSTED.
    """
    try:
        yield
    except ResourceExhausted as exc:
        entry.loading = False
        if not entry.versions and entry.cold_reason is None:
            entry.error = exc.message
        raise
    except Exception as exc:
        reason = reason_of(exc)
        record_failure(entry, reason, fingerprint, exc)
        raise LoadError(reason) from exc


def record_failure(
    entry: ModelEntry, reason: str, fingerprint: str, exc: BaseException | None = None
) -> None:
    """Keep the reason on the entry, tied to the source it failed for (an unchanged broken model is not
    retried in a loop), and log it once: a repeat of the same failure for the same source is not news."""
    repeated = entry.error == reason and entry.failed_fingerprint == fingerprint
    entry.error, entry.failed_fingerprint, entry.loading = reason, fingerprint, False
    if repeated:
        return
    if exc is not None and not isinstance(exc, MpsdError):
        log.error("unexpected error in a model's load", model=entry.name, exc_info=exc)
    if entry.versions:
        log.error("model update failed; previous version keeps serving", model=entry.name, reason=reason)
    else:
        log.error("model failed to load", model=entry.name, reason=reason)
