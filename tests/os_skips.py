"""Skips for what a system cannot run, each saying why, decided by `mpsd.osfacts` rather than
`sys.platform`: with darwin's facts in force (MPSD_OS_FACTS=darwin), a run here takes the path a Mac takes,
so a Linux-only test is seen to skip, not to fail, before the suite ever meets a Mac."""

from __future__ import annotations

import pytest

from mpsd import osfacts


def on_linux() -> bool:
    """Linux's facts are in force: a Linux host, unless darwin's are put in force."""
    return osfacts.current().name == "linux"


def linux_only(why: str) -> pytest.MarkDecorator:
    """Skip elsewhere, saying what the test needs that only Linux has."""
    return pytest.mark.skipif(not on_linux(), reason=f"Linux only: {why}")


def shared_port_fronts() -> pytest.MarkDecorator:
    """For tests of front processes sharing the daemon's port (`front_processes`)."""
    return pytest.mark.skipif(
        not (on_linux() and osfacts.current().reuseport_balances),
        reason="Linux only: front processes share one port through SO_REUSEPORT, which spreads connections "
        "only on Linux; macOS runs fronts on ports of their own (front_ports, tests/test_front_ports.py)",
    )


def not_installed(tool: str) -> str:
    """A skip reason for a missing tool, with the command that installs it on this system."""
    return f"not installed: {tool} (`{osfacts.current().package_hint}` installs it)"
