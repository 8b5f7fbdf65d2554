"""The operating system's facts: darwin's can be put in force on Linux, in-process and in a child."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

from mpsd import osfacts


def test_the_real_systems_facts_are_in_force_by_default() -> None:
    expected = osfacts.for_platform(sys.platform)
    if osfacts.ENV not in os.environ:
        assert osfacts.current() == expected


def test_darwin_facts_are_macos_limits() -> None:
    darwin = osfacts.for_platform("darwin")
    assert darwin.unix_path_max == 104 and darwin.shm_name_max == 31
    assert darwin.shm_dir is None and not darwin.shm_resizable
    assert darwin.default_nofile_soft == 256 and darwin.nofile_ceiling == 10240
    assert errno.ENOBUFS in darwin.dgram_full_errnos
    assert "Documents" in darwin.tcc_home_folders and darwin.unified_memory


def test_use_puts_facts_in_force_for_a_block() -> None:
    before = osfacts.current()
    with osfacts.use(osfacts.DARWIN):
        assert osfacts.current() is osfacts.DARWIN
        assert osfacts.child_env() == ({} if sys.platform == "darwin" else {osfacts.ENV: "darwin"})
    assert osfacts.current() is before


def test_a_child_process_takes_the_facts_from_its_environment() -> None:
    env = {**os.environ, **osfacts.child_env(osfacts.DARWIN)}
    out = subprocess.run(
        [sys.executable, "-c", "from mpsd import osfacts; print(osfacts.current().unix_path_max)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "104"


def test_an_unknown_name_is_refused() -> None:
    env = {**os.environ, osfacts.ENV: "plan9"}
    out = subprocess.run(
        [sys.executable, "-c", "import mpsd.osfacts"], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "plan9" in out.stderr
