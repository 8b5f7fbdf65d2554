"""`mpsd service install|uninstall|start|stop|restart|status|logs`: argument parsing and error reporting.

Each handler turns arguments into a `Target`/`ServiceSpec`, calls the chosen `ServiceManager`, and maps
`ServiceError` to one line on stderr plus a hint, so users never see a traceback for expected failures.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from mpsd.cli.connection import add_credential_args
from mpsd.errors import ConfigError
from mpsd.service import privacy
from mpsd.service.errors import ServiceError
from mpsd.service.health import HealthTimeout, wait_until_serving
from mpsd.service.launchctl import LaunchdManager
from mpsd.service.manager import MANAGERS, ServiceManager, default_manager
from mpsd.service.runner import Runner
from mpsd.service.spec import (
    DEFAULT_ADDRESS,
    DEFAULT_CONFIG,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_LABEL,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_THROTTLE_S,
    DEFAULT_UNIT,
    DEFAULT_WATCHDOG_S,
    Scope,
    ServiceSpec,
    check_privileges,
    drain_timeout_from_config,
    health_address_from_config,
    make_spec,
    make_target,
    parse_env_assignments,
    service_account_home,
    shutdown_grace_from_config,
)
from mpsd.service.systemctl import SystemdManager

Handler = Callable[[argparse.Namespace], int]
EXIT_FAILURE = 1
EXIT_NOT_RUNNING = 3  # what `systemctl status` and LSB init scripts use for "not running"


def _fail(message: str, hint: str | None) -> None:
    print(f"mpsd service: error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def _guarded(handler: Handler) -> Handler:
    """Expected failures become one line plus a hint and a non-zero exit, never a traceback."""

    @functools.wraps(handler)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ServiceError as exc:
            _fail(exc.message, exc.hint)
        except PermissionError as exc:
            _fail(f"permission denied: {exc.filename}", "use --user, or run with sudo for --system")
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            _fail(f"{exc.strerror or exc}{where}", None)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return EXIT_FAILURE

    return wrapper


def _manager(args: argparse.Namespace) -> ServiceManager:
    runner = Runner(dry_run=args.dry_run)
    name = args.manager or default_manager()
    target = make_target(Scope(args.scope), label=args.label, unit=args.unit)
    if name == "launchd":
        return LaunchdManager(target, runner, progress=sys.stderr)
    return SystemdManager(target, runner, progress=sys.stderr)


def _require_privileges(args: argparse.Namespace) -> None:
    """Changing a system service needs root; a dry run only prints, so anyone may do it."""
    if not args.dry_run:
        check_privileges(Scope(args.scope), os.geteuid())


def _wait_ready(manager: ServiceManager, args: argparse.Namespace, address: str | None = None) -> None:
    if args.no_wait:
        return
    address = address or args.address or DEFAULT_ADDRESS
    if args.dry_run:
        print(
            f"# then wait up to {args.wait_timeout:g} s for grpc.health.v1.Health/Check(service='') "
            f"to return SERVING on {address}"
        )
        return
    try:
        wait_until_serving(address, args.wait_timeout, progress=sys.stderr, credentials=args)
    except HealthTimeout as exc:
        status = manager.status()
        raise ServiceError(
            f"mpsd did not report SERVING on {address} within {args.wait_timeout:g} s "
            f"(last health check: {exc.last})",
            hint=f"service is {status.summary()}; {manager.describe_logs()}",
        ) from None


def _check_config(path: Path) -> Path:
    """Refuse to install a service whose config the daemon would refuse: it would exit 78 at every start,
    and launchd, which cannot tell exit statuses apart, would start it again and again. Returns the model
    repository it names."""
    from mpsd.cli.serve import check_servable
    from mpsd.config.daemon_config import load_daemon_config

    try:
        config = load_daemon_config(path)
        # The event loop is the daemon's to check: uvloop is the service's interpreter's to have.
        check_servable(config, event_loop=False)
    except ConfigError as exc:
        raise ServiceError(
            f"configuration error: {exc.message}",
            hint=f"fix {path} (`mpsd serve --config {path}` checks it); nothing was installed",
        ) from None
    return config.model_repository


def _check_privacy(spec: ServiceSpec, repository: Path) -> None:
    """Refuse paths a launchd job may not open (macOS's privacy-protected folders): the job would fail
    with EPERM at every start, and install would wait out its timeout before saying so."""
    paths = privacy.service_paths(spec.python, Path(spec.config), repository, Path(spec.working_dir))
    found = privacy.protected(paths)
    if found:
        listed = "; ".join(f"{p.what} {p.path}" for p in found)
        raise ServiceError(
            f"in a privacy-protected folder, which a launchd job cannot open: {listed}",
            hint=privacy.hint(found, spec.python)
            + ", then install with --allow-protected-folders; nothing was installed",
        )


@_guarded
def _install(args: argparse.Namespace) -> int:
    _require_privileges(args)
    manager = _manager(args)
    scope = Scope(args.scope)
    config = Path(args.config).expanduser().resolve()
    drain = args.drain_timeout
    if drain is None:
        drain = drain_timeout_from_config(config) or DEFAULT_DRAIN_TIMEOUT_S
    grace = shutdown_grace_from_config(config)
    address = args.address or health_address_from_config(config) or DEFAULT_ADDRESS
    service_user = args.service_user or manager.default_service_user
    if scope is Scope.SYSTEM and not args.dry_run:
        service_account_home(service_user)  # the account must exist, even with --service-home
    target = make_target(scope, label=args.label, unit=args.unit)
    spec = make_spec(
        target,
        config=config,
        base_path=manager.base_path,
        python=args.python,
        drain_timeout_s=drain,
        shutdown_grace_s=DEFAULT_SHUTDOWN_GRACE_S if grace is None else grace,
        throttle_s=args.throttle_interval,
        watchdog_s=args.watchdog_sec,
        start_timeout_s=args.start_timeout,
        environment=parse_env_assignments(args.env),
        working_dir=args.working_dir,
        service_user=service_user if scope is Scope.SYSTEM else None,
        service_home=args.service_home,
    )
    repository = _check_config(config)  # after make_spec, which says plainly when the file is missing
    if not args.allow_protected_folders:
        _check_privacy(spec, repository)
    manager.install(spec)
    _wait_ready(manager, args, address)
    if not args.dry_run:
        print(f"mpsd is installed as a {manager.name} {scope.value} service and serving on {address}")
        print(manager.describe_logs())
    return 0


@_guarded
def _uninstall(args: argparse.Namespace) -> int:
    _require_privileges(args)
    _manager(args).uninstall()
    return 0


@_guarded
def _start(args: argparse.Namespace) -> int:
    _require_privileges(args)
    manager = _manager(args)
    manager.start()
    _wait_ready(manager, args)
    return 0


@_guarded
def _stop(args: argparse.Namespace) -> int:
    _require_privileges(args)
    _manager(args).stop()
    return 0


@_guarded
def _restart(args: argparse.Namespace) -> int:
    _require_privileges(args)
    manager = _manager(args)
    manager.restart()
    _wait_ready(manager, args)
    return 0


@_guarded
def _status(args: argparse.Namespace) -> int:
    manager = _manager(args)
    status = manager.status()
    if args.dry_run:
        return 0
    name = args.label if manager.name == "launchd" else args.unit
    print(f"{name}: {status.summary()}")
    if status.problem is not None:
        print(f"  not serving: configuration error: {status.problem}")
    print(f"  {status.where}")
    print(f"  {manager.describe_logs()}")
    return 0 if status.running and status.problem is None else EXIT_NOT_RUNNING


@_guarded
def _logs(args: argparse.Namespace) -> int:
    if args.lines < 0:
        raise ServiceError("--lines must not be negative")
    return _manager(args).logs(lines=args.lines, follow=args.follow)


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    scope = common.add_mutually_exclusive_group()
    scope.add_argument(
        "--user",
        dest="scope",
        action="store_const",
        const=Scope.USER.value,
        default=Scope.USER.value,
        help="per-user service: LaunchAgent / systemd --user (default)",
    )
    scope.add_argument(
        "--system",
        dest="scope",
        action="store_const",
        const=Scope.SYSTEM.value,
        help="system service started at boot: LaunchDaemon / system unit (needs root)",
    )
    common.add_argument(
        "--manager", choices=MANAGERS, help="service manager (default: launchd on macOS, systemd on Linux)"
    )
    common.add_argument("--label", default=DEFAULT_LABEL, help=f"launchd label (default: {DEFAULT_LABEL})")
    common.add_argument("--unit", default=DEFAULT_UNIT, help=f"systemd unit name (default: {DEFAULT_UNIT})")
    common.add_argument(
        "--dry-run", action="store_true", help="print the files and commands instead of running them"
    )
    return common


def _wait_options() -> argparse.ArgumentParser:
    waiting = argparse.ArgumentParser(add_help=False)
    waiting.add_argument(
        "--address",
        help=f"gRPC address polled for health (default: {DEFAULT_ADDRESS}; "
        "install uses grpc_address from --config)",
    )
    waiting.add_argument(
        "--wait-timeout",
        type=float,
        default=float(DEFAULT_START_TIMEOUT_S),
        metavar="SECONDS",
        help=f"how long to wait for SERVING (default: {DEFAULT_START_TIMEOUT_S})",
    )
    waiting.add_argument("--no-wait", action="store_true", help="do not wait for the health check")
    add_credential_args(waiting)  # a daemon with TLS or tokens answers the health check only with them
    return waiting


def _add_install_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"daemon config (default: {DEFAULT_CONFIG})")
    parser.add_argument("--python", help="interpreter that runs the daemon (default: this one)")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="daemon's drain timeout (default: drain_timeout_s from the config, else 30)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment, e.g. PYTORCH_ENABLE_MPS_FALLBACK=1 (repeatable)",
    )
    parser.add_argument("--working-dir", help="working directory (default: the config's directory)")
    parser.add_argument(
        "--allow-protected-folders",
        action="store_true",
        help="install although a path is in a macOS privacy-protected folder (~/Documents, ~/Desktop, "
        "~/Downloads, iCloud Drive, /Volumes): the service's python has Full Disk Access",
    )
    parser.add_argument(
        "--service-user", help="account a --system service runs as (default: _mpsd on macOS, mpsd on Linux)"
    )
    parser.add_argument("--service-home", help="HOME for a --system service (default: the account's home)")
    parser.add_argument(
        "--throttle-interval",
        type=int,
        default=DEFAULT_THROTTLE_S,
        metavar="SECONDS",
        help=f"minimum seconds between restarts (default: {DEFAULT_THROTTLE_S})",
    )
    parser.add_argument(
        "--watchdog-sec",
        type=int,
        default=DEFAULT_WATCHDOG_S,
        metavar="SECONDS",
        help=f"systemd WatchdogSec, 0 to disable (default: {DEFAULT_WATCHDOG_S})",
    )
    parser.add_argument(
        "--start-timeout",
        type=int,
        default=DEFAULT_START_TIMEOUT_S,
        metavar="SECONDS",
        help=f"systemd TimeoutStartSec (default: {DEFAULT_START_TIMEOUT_S})",
    )


def add_service_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `service` and its commands; each sets `func(args) -> int` as its handler."""
    service = subparsers.add_parser(
        "service",
        help="install and control mpsd as a launchd (macOS) or systemd (Linux) service",
        description="Install and control mpsd as a launchd (macOS) or systemd (Linux) service.",
        epilog="example: mpsd service install --config config/mpsd.yaml",
    )
    commands = service.add_subparsers(dest="service_command", metavar="COMMAND", required=True)
    common, waiting = _common_options(), _wait_options()
    table: list[tuple[str, Handler, str, str, list[argparse.ArgumentParser]]] = [
        (
            "install",
            _install,
            "write the plist/unit, load it and wait until mpsd serves",
            "--system --config /etc/mpsd/mpsd.yaml",
            [common, waiting],
        ),
        ("uninstall", _uninstall, "stop the service and remove the plist/unit", "--user", [common]),
        ("start", _start, "start the installed service", "--system", [common, waiting]),
        ("stop", _stop, "stop the service (until the next start, login or boot)", "--system", [common]),
        ("restart", _restart, "restart the service", "--no-wait", [common, waiting]),
        ("status", _status, "show state, pid and last exit status", "--system", [common]),
        ("logs", _logs, "show the service's logs", "-n 200 -f", [common]),
    ]
    for name, handler, help_text, example, parents in table:
        parser = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=f"example: mpsd service {name} {example}",
            parents=parents,
        )
        parser.set_defaults(func=handler)
        if name == "install":
            _add_install_options(parser)
        elif name == "logs":
            parser.add_argument("-n", "--lines", type=int, default=50, help="lines to show (default: 50)")
            parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")


def main(argv: list[str] | None = None) -> int:
    """`python -m mpsd.service COMMAND ...`: the service commands alone, parsed as `mpsd service COMMAND`."""
    parser = argparse.ArgumentParser(prog="mpsd")
    add_service_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["service", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result
