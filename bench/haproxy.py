"""HAProxy with deploy/haproxy/mpsd.cfg in front of daemons on loopback: the configuration written for any
number of daemons, checked, started (optionally pinned to some cores), and its view of the daemons read
from its CSV statistics. Used by tests/test_scale_out.py and bench/scale_out.py."""

from __future__ import annotations

import csv
import http.client
import io
import os
import re
import socket
import subprocess
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from bench.cpus import pinned_to

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "mpsd.cfg"
_SERVER = re.compile(r"^(\s*server mpsd)(\d+)( .*)$")


def haproxy_config(daemons: int, template: Path = CONFIG) -> str:
    """The configuration for `daemons` daemons (MPSD1_* to MPSD<daemons>_* in the environment).

    Each backend keeps its `server mpsdN` lines for N up to `daemons`. A backend that lists every daemon of
    the template gets lines for the daemons beyond them, written like its last one; a backend that lists
    only some (a model only some daemons serve) stays a subset. For the template's own count the text
    comes back unchanged."""
    if daemons < 1:
        raise ValueError("at least one daemon")
    lines = template.read_text().splitlines(keepends=True)
    everyone = max(int(m.group(2)) for line in lines if (m := _SERVER.match(line.rstrip("\n"))))
    out: list[str] = []
    block: list[tuple[int, str]] = []  # the server lines of one backend: (daemon, line)

    def flush() -> None:
        out.extend(line for n, line in block if n <= daemons)
        if [n for n, _ in block] == list(range(1, everyone + 1)):
            last = block[-1][1]
            for n in range(everyone + 1, daemons + 1):
                out.append(
                    last.replace(f"mpsd{everyone}", f"mpsd{n}").replace(f"MPSD{everyone}_", f"MPSD{n}_")
                )
        block.clear()

    for line in lines:
        match = _SERVER.match(line.rstrip("\n"))
        if match is not None:
            block.append((int(match.group(2)), line))
            continue
        flush()
        out.append(line)
    flush()
    return "".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HAProxy:
    """HAProxy on loopback ports of its own in front of daemons given as (gRPC address, HTTP address)."""

    def __init__(
        self,
        binary: str,
        daemons: Sequence[tuple[str, str]],
        workdir: Path,
        cpus: Collection[int] | None = None,
        ports: tuple[int, int, int] | None = None,
    ) -> None:
        grpc_port, http_port, stats_port = ports or (free_port(), free_port(), free_port())
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.http = f"127.0.0.1:{http_port}"
        self.stats = f"127.0.0.1:{stats_port}"
        self.env = {"MPSD_GRPC_BIND": self.grpc, "MPSD_HTTP_BIND": self.http, "MPSD_STATS_BIND": self.stats}
        for n, (grpc_address, http_address) in enumerate(daemons, 1):
            host, _, grpc_port_text = grpc_address.rpartition(":")
            self.env[f"MPSD{n}_HOST"] = host
            self.env[f"MPSD{n}_GRPC_PORT"] = grpc_port_text
            self.env[f"MPSD{n}_HTTP_PORT"] = http_address.rpartition(":")[2]
        self.config = workdir / f"haproxy-{len(daemons)}.cfg"
        self.config.write_text(haproxy_config(len(daemons)))
        check = subprocess.run(
            [binary, "-c", "-f", str(self.config)],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            raise RuntimeError(f"haproxy -c failed: {check.stdout}{check.stderr}")
        self.cpus = sorted(cpus) if cpus else None
        self.log = workdir / f"haproxy-{len(daemons)}.log"
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(self.config)],
            env={**os.environ, **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=pinned_to(cpus),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def servers(self) -> dict[tuple[str, str], str]:
        """HAProxy's view: (backend, server) -> status (UP, DOWN, ...), from its CSV statistics."""
        host, _, port = self.stats.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            connection.request("GET", "/stats;csv")
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"HAProxy statistics answered {response.status}")
        rows = csv.DictReader(io.StringIO(raw.decode().lstrip("# ")))
        return {
            (r["pxname"], r["svname"]): r["status"]
            for r in rows
            if r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_all_up(self, backends: Collection[str] = (), timeout_s: float = 60.0) -> None:
        """Until HAProxy has found every server of `backends` (default: all) UP; RuntimeError if it exits,
        TimeoutError if that takes longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                servers = self.servers()
                if {s for (b, _), s in servers.items() if not backends or b in backends} == {"UP"}:
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every server UP in HAProxy after {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
