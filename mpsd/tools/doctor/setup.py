"""The daemon's own setup: its config, the ports it would listen on, the model repository, the service,
and whether a service could open its files (macOS's privacy-protected folders)."""

from __future__ import annotations

import errno
import io
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.tools.doctor.report import Check, Setup, failed, passed

DEFAULT_CONFIG = Path("config/mpsd.yaml")


def read_setup(path: Path | None) -> Setup:
    """The config `mpsd serve` would read: `path`, else config/mpsd.yaml when present, else the defaults."""
    from mpsd.config.daemon_config import load_daemon_config
    from mpsd.errors import ConfigError

    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    try:
        return Setup(path, load_daemon_config(path))
    except ConfigError as exc:
        return Setup(path, None, exc.message)


def _named(setup: Setup) -> str:
    return str(setup.path) if setup.path is not None else "no config file (the built-in defaults)"


def config(setup: Setup, check_servable: Callable[[DaemonConfig], None]) -> Check:
    """The config as `mpsd serve` checks it before it starts (`check_servable`, which the command line
    owns)."""
    from mpsd.errors import ConfigError

    fix = f"fix {setup.path}; `mpsd serve --config {setup.path}` checks it the same way"
    if setup.config is None:
        return failed("config", f"{_named(setup)}: {setup.error}", fix)
    try:
        check_servable(setup.config)
    except ConfigError as exc:
        return failed("config", f"{_named(setup)}: {exc.message}", fix)
    return passed("config", f"{_named(setup)}: the daemon accepts it")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections there (a wildcard host is asked on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def ports(setup: Setup) -> Check:
    """Every TCP port the config listens on, free (as the daemon's own check finds it) or taken."""
    from mpsd.daemon.supervise.fronts.policy import check_port_free, front_address, own_ports
    from mpsd.net.listen import Address, http_address, openai_address, parse_address

    if setup.config is None:
        return failed("ports", "not checked: the config did not load", "see the config check")
    cfg = setup.config
    grpc = parse_address(cfg.grpc_address)
    wanted: list[tuple[str, Address | None]] = [
        ("grpc_address", grpc),
        ("http_address", http_address(cfg.http_address)),
        ("openai_address", openai_address(cfg.openai_address)),
    ]
    metrics = cfg.metrics_address
    if metrics is not None and metrics.strip().lower() not in ("", "off"):
        host, _, port = metrics.rpartition(":")
        wanted.append(
            ("metrics_address", Address(metrics, host=host.strip("[]") or "0.0.0.0", port=int(port)))
        )
    if grpc.unix_path is None:
        wanted += [("front_ports", front_address(grpc, p)) for p in own_ports(cfg)]
    free: list[str] = []
    taken: list[str] = []
    bsd = osfacts.current().specific_bind_beside_wildcard  # a wildcard listener does not stop the bind
    for setting, address in wanted:
        if address is None or address.unix_path is not None:
            continue
        try:
            check_port_free(address)
            in_use = bsd and _listening(address.host, address.port)
        except OSError as exc:
            if exc.errno not in (None, errno.EADDRINUSE):
                raise
            in_use = True
        entry = f"port {address.port} ({setting} {address.text})"
        (taken if in_use else free).append(entry)
    if taken:
        return failed(
            "ports",
            f"in use: {', '.join(taken)}",
            "stop what listens there (`lsof -nP -iTCP:PORT -sTCP:LISTEN` names it; an mpsd already "
            f"running?) or choose another port in {_named(setup)}",
        )
    return passed("ports", f"free: {', '.join(free)}" if free else "no TCP ports configured")


def repository(setup: Setup) -> Check:
    """The checks of `mpsd validate` (without --load) on the configured repository."""
    from mpsd.tools.common import ToolError
    from mpsd.tools.validate import check_repository

    if setup.config is None:
        return failed("repository", "not checked: the config did not load", "see the config check")
    cfg = setup.config
    repo = cfg.model_repository
    try:
        reports = check_repository(repo, False, cfg.allow_symlinks, lambda _: None, cfg.op_library_dirs)
    except ToolError as exc:
        return failed("repository", exc.message, exc.hint)
    fix = f"`mpsd validate {repo}` lists every problem with its fix"
    if not reports:
        return failed(
            "repository",
            f"{repo}: no models",
            f"add one: `mpsd init-model NAME --from FILE --repository {repo}`",
        )
    bad = [r for r in reports if not r.ok]
    if bad:
        first = bad[0].problems[0] if bad[0].problems else None
        why = ""
        if first is not None:
            why = f" ({bad[0].name}: {f'{first.field}: ' if first.field else ''}{first.problem})"
            fix = f"{first.hint}; {fix}"
        return failed("repository", f"{repo}: {len(bad)} of {len(reports)} models invalid{why}", fix)
    names = ", ".join(r.name for r in reports)
    return passed("repository", f"{repo}: {len(reports)} models valid ({names})")


def service() -> Check:
    """The service as launchd or systemd knows it, per scope; not installed is fine."""
    from mpsd.service.errors import ServiceError
    from mpsd.service.launchctl import LaunchdManager
    from mpsd.service.manager import ServiceManager, default_manager
    from mpsd.service.runner import Runner
    from mpsd.service.spec import Scope, make_target
    from mpsd.service.systemctl import SystemdManager

    try:
        name = default_manager()
    except ServiceError as exc:
        return passed("service", exc.message)
    states, problems = [], []
    for scope in Scope:
        target = make_target(scope)
        runner = Runner(out=io.StringIO(), echo=io.StringIO())
        manager: ServiceManager = (
            LaunchdManager(target, runner, progress=io.StringIO())
            if name == "launchd"
            else SystemdManager(target, runner, progress=io.StringIO())
        )
        try:
            status = manager.status()
        except ServiceError as exc:  # e.g. no systemd user session: nothing to report about the service
            states.append(f"{scope.value}: unknown ({exc.message.rpartition('): ')[2]})")
            continue
        states.append(f"{scope.value}: {status.summary()}")
        if status.loaded and (not status.running or status.problem is not None):
            problems.append(f"{scope.value}: {status.problem or status.summary()}")
    detail = f"{name}: {'; '.join(states)}"
    if problems:
        return failed("service", detail, "`mpsd service status` and `mpsd service logs` say why")
    return passed("service", detail)


def privacy(setup: Setup) -> Check:
    """Whether a launchd job could open the checkout, the interpreter, the config and the repository."""
    from mpsd.service import privacy as tcc

    folders = tcc.protected_folders()
    if not folders:
        return passed("privacy_folders", f"{osfacts.current().name} has no privacy-protected folders")
    repo = setup.config.model_repository if setup.config is not None else None
    config_path = setup.path.resolve() if setup.path is not None else None
    paths = tcc.service_paths(sys.executable, config_path, repo)
    found = tcc.protected(paths)
    if found:
        listed = "; ".join(f"{p.what} {p.path} (in {p.folder})" for p in found)
        return failed(
            "privacy_folders", f"a launchd service cannot open: {listed}", tcc.hint(found, sys.executable)
        )
    checked = ", ".join(what for what, _ in paths)
    return passed("privacy_folders", f"{checked}: outside {', '.join(map(str, folders))}")
