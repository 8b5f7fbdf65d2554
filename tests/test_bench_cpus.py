"""The benchmarks' CPU helpers on a system without CPU affinity or /proc/cpuinfo (macOS), and on Linux."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def macos_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No affinity calls, no /proc/cpuinfo, and a `sysctl` that answers as a Mac's does."""
    for name in ("sched_getaffinity", "sched_setaffinity"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.setattr(cpus, "CPUINFO", tmp_path / "no-proc" / "cpuinfo")
    sysctl = tmp_path / "bin" / "sysctl"
    sysctl.parent.mkdir()
    sysctl.write_text('#!/bin/sh\n[ "$*" = "-n machdep.cpu.brand_string" ] && echo "Apple M2 Pro"\n')
    sysctl.chmod(sysctl.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{sysctl.parent}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_without_affinity_every_cpu_is_usable_and_nothing_is_pinned(macos_like: Path) -> None:
    assert cpus.usable_cpus() == list(range(os.cpu_count() or 1))
    assert not cpus.can_pin()
    assert cpus.affinity(os.getpid()) is None
    assert cpus.pinned_to({0}) is None
    cpus.pin_threads([os.getpid()], {0})  # nothing to do, and no AttributeError


def test_without_proc_cpuinfo_the_cpu_is_named_by_sysctl(macos_like: Path) -> None:
    assert cpus.cpu_name() == "Apple M2 Pro"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_with_affinity_a_started_process_is_pinned() -> None:
    cpu = cpus.usable_cpus()[-1]
    shown = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=cpus.pinned_to({cpu}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == f"[{cpu}]"


def test_only_bench_cpus_calls_the_linux_affinity_functions() -> None:
    """The rest of bench/ asks bench.cpus, which knows macOS has none of them."""
    callers = [
        path.name
        for path in (ROOT / "bench").glob("*.py")
        if path.name != "cpus.py" and re.search(r"os\.sched_(get|set)affinity", path.read_text())
    ]
    assert callers == []


def test_the_in_process_baseline_gives_torch_the_workers_openmp_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process reference runs torch as a worker would (`bench/inprocess.py` reads the worker's rule
    and the CPUs it may use from mpsd itself): on a machine of at most 4 usable CPUs OpenMP's spinning is
    bounded unless a policy is set; on a larger one nothing is added."""
    from bench.inprocess import worker_openmp_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert worker_openmp_env({}) == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
    assert worker_openmp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert worker_openmp_env({}) == {}
    # macOS's fact: no affinity call at all; every CPU of the machine counts.
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert worker_openmp_env({}) == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
    monkeypatch.setattr(os, "cpu_count", lambda: 10)
    assert worker_openmp_env({}) == {}
