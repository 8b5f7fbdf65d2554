"""The daemon's own settings (`config/mpsd.yaml`), as opposed to a model's config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mpsd import osfacts
from mpsd.config.model_file import format_validation_error, validation_issues, yaml_issue
from mpsd.config.security import AuthConfig, TlsConfig, read_tokens
from mpsd.errors import ConfigError, Issue
from mpsd.logs.levels import LogLevel

DeviceType = Literal["cpu", "cuda", "mps"]
DEFAULT_BUDGET: dict[DeviceType, float] = {"cpu": 0.5, "cuda": 0.9, "mps": 0.8}
# The soft open-file limit the daemon raises itself to (macOS's OPEN_MAX; see `open_files`).
DEFAULT_OPEN_FILES = 10240


def _default_busy_poll_us() -> int:
    """Spinning trades CPU (and a laptop's battery) for latency: on by default, off on macOS."""
    return 0 if osfacts.current().name == "darwin" else 200


class ResidencyDefaults(BaseModel):
    """How models come and go from memory, for models whose config does not say (`residency` there)."""

    model_config = ConfigDict(extra="forbid")

    load: Literal["startup", "on_demand"] = Field(
        "startup", description="startup: loaded when the daemon starts; on_demand: at its first request."
    )
    keep_alive_s: Annotated[float, Field(ge=0)] | Literal["never"] = Field(
        "never", description="Idle time (no request in flight or queued) after which a model is unloaded."
    )
    pinned: bool = Field(False, description="Pinned models are never evicted to make room.")
    min_residency_s: Annotated[float, Field(ge=0)] = Field(
        10.0, description="A model loaded less than this long ago is not evicted (no thrashing)."
    )
    load_timeout_s: Annotated[float, Field(gt=0)] = Field(
        300.0, description="Longest a request waits for its model to load on demand (or its deadline)."
    )
    load_queue_size: Annotated[int, Field(ge=1)] = Field(
        64, description="Requests that may wait for one model's load on demand; more are refused."
    )


TraceLevel = Literal["OFF", "TIMESTAMPS", "TENSORS"]


class TraceConfig(BaseModel):
    """Request tracing with OpenTelemetry (docs/observability.md, Traces): Triton's trace settings, whose
    values here are the defaults the TraceSetting API returns to when a setting is cleared."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["opentelemetry"] = Field(
        "opentelemetry", description="How traces are made: OpenTelemetry spans sent to `endpoint` (OTLP)."
    )
    level: list[TraceLevel] = Field(
        ["OFF"],
        description="OFF: no request is traced (nothing of OpenTelemetry is even imported); TIMESTAMPS: "
        "requests are traced (TENSORS is accepted, and traces the same spans, as in Triton's "
        "opentelemetry mode).",
    )
    rate: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(
        1000,
        description="One request in `rate` is traced (1: every one; 0: only requests that carry a W3C "
        "traceparent, which are always traced).",
    )
    count: Annotated[int, Field(ge=-1, le=2**31 - 1)] = Field(
        -1, description="How many more requests are traced by sampling (-1: no limit)."
    )
    log_frequency: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(
        0, description="Triton's setting for its own trace files; kept and accepted, without effect here."
    )
    endpoint: str | None = Field(
        None,
        description="Where spans go: an OTLP/HTTP URL (default http://localhost:4318/v1/traces) or, with "
        "protocol grpc, an OTLP/gRPC host:port (default localhost:4317).",
    )
    protocol: Literal["http", "grpc"] = Field("http", description="OTLP over HTTP (protobuf) or gRPC.")
    insecure: bool = Field(True, description="OTLP/gRPC without TLS.")
    resource: dict[str, str] = Field(
        default_factory=dict,
        description="Resource attributes of every span (service.name is mpsd unless given).",
    )
    bsp_schedule_delay_ms: Annotated[int, Field(gt=0)] = Field(
        5000, description="Batch span processor: longest time between two exports."
    )
    bsp_max_queue_size: Annotated[int, Field(gt=0)] = Field(
        2048, description="Batch span processor: spans kept for export; more are dropped."
    )
    bsp_max_export_batch_size: Annotated[int, Field(gt=0)] = Field(
        512, description="Batch span processor: most spans per export."
    )

    @field_validator("level", mode="before")
    @classmethod
    def _one_level(cls, value: object) -> object:
        """`level: TIMESTAMPS` as well as a list; a bare YAML `OFF` reads as false."""
        if value is False:
            return ["OFF"]
        return [value] if isinstance(value, str) else value

    @field_validator("level")
    @classmethod
    def _off_alone(cls, value: list[str]) -> list[str]:
        if "OFF" in value and len(value) > 1:
            raise ValueError("Expect only one trace level 'OFF' is specified")
        return value or ["OFF"]

    @property
    def url(self) -> str:
        if self.endpoint:
            return self.endpoint
        return "localhost:4317" if self.protocol == "grpc" else "http://localhost:4318/v1/traces"


class DaemonConfig(BaseModel):
    """Settings of one mpsd daemon. Paths are resolved relative to the config file's directory."""

    model_config = ConfigDict(extra="forbid")

    model_repository: Path = Field(Path("models"), description="Directory holding one folder per model.")
    grpc_address: str = Field(
        "127.0.0.1:8001",
        description="host:port (Triton's port by default), or unix:///path/mpsd.sock for a Unix socket "
        "only the daemon's user can open (mode 0600).",
    )
    http_address: str | None = Field(
        "127.0.0.1:8000",
        description="host:port of the KServe v2 HTTP/REST protocol (Triton's HTTP port), or "
        'unix:///path/mpsd-http.sock for a Unix socket only the daemon\'s user can open (mode 0600); "", '
        '"off" or null disable it. Same TLS and tokens as gRPC.',
    )
    openai_address: str = Field(
        "http",
        description="Where OpenAI's API is served (docs/openai.md): `http` on http_address, beside the "
        'KServe routes; host:port or unix:///path on a port of its own (same TLS and tokens); "" or "off": '
        "not served.",
    )
    metrics_address: str | None = Field(
        "127.0.0.1:8002",
        description='host:port of the Prometheus endpoint (Triton\'s port); "", "off" or null disable it.',
    )
    response_cache_bytes: Annotated[int, Field(ge=0)] = Field(
        64 * 1024 * 1024,
        description="Size of the response cache shared by the models that enable it (`response_cache`), "
        "least recently used entries dropped first; 0 turns it off.",
    )
    server_name: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        "mpsd",
        description="The name ServerMetadata (gRPC) and GET /v2 (HTTP) report; `triton` for clients that "
        "check for Triton's.",
    )
    log_level: LogLevel = "info"
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: JSON lines unless stderr is a terminal."
    )
    drain_timeout_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="How long in-flight requests may take to finish at shutdown or unload."
    )
    shutdown_grace_s: Annotated[float, Field(ge=0)] = Field(
        5.0,
        description="At SIGTERM, how long health already reports NOT_SERVING (HTTP readiness 503) while new "
        "calls are still served, so that load balancers and health-checking clients stop sending before "
        "the drain (drain_timeout_s) refuses calls. 0: drain at once.",
    )
    max_connection_age_s: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="gRPC: a client connection older than this (give or take 10%) is asked to reconnect "
        "(HTTP/2 GOAWAY), so that long-lived clients rebalance over hosts added since. 0: never.",
    )
    max_connection_age_grace_s: Annotated[float, Field(ge=0)] = Field(
        30.0,
        description="gRPC: how long calls in progress on a connection past max_connection_age_s may take "
        "before it is closed.",
    )
    worker_start_timeout_s: Annotated[float, Field(gt=0)] = Field(
        300.0, description="Longest a worker may take to load and warm up its model."
    )
    worker_stop_timeout_s: Annotated[float, Field(gt=0)] = Field(
        5.0, description="Grace period between TERM and KILL when stopping a worker."
    )
    request_timeout_s: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="A worker that has not answered a request within this many seconds is considered hung, "
        "killed and restarted (0: no limit).",
    )
    heartbeat_timeout_s: Annotated[float, Field(ge=0)] = Field(
        10.0,
        description="A worker silent for this long (stopped, wedged) is killed and restarted (0: off).",
    )
    restart_backoff_initial_s: Annotated[float, Field(gt=0)] = Field(
        0.5, description="First delay before restarting a dead worker; doubles on each failure."
    )
    restart_backoff_max_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="Cap on the restart delay."
    )
    memory_budget_policy: Literal["refuse", "warn"] = Field(
        "refuse",
        description="What to do when the memory fractions on one device add up to more than 1.0.",
    )
    memory_budget: dict[DeviceType, Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: dict(DEFAULT_BUDGET),
        description="Share of each device's memory that loaded models may hold together: system RAM for "
        "cpu, each GPU's total memory for cuda, Metal's recommended working set for mps. On unified memory "
        "(Apple Silicon) cpu and mps are one budget, cpu+mps: the larger of the two, not their sum.",
    )
    memory_budget_bytes: dict[str, Annotated[int, Field(gt=0)]] = Field(
        default_factory=dict,
        description="A budget in bytes for a device (cpu, cuda:N, mps), in place of its share.",
    )
    residency: ResidencyDefaults = Field(
        default_factory=ResidencyDefaults, description="Load on demand, idle unload and eviction defaults."
    )
    model_control: Literal["watch", "poll", "explicit", "none"] = Field(
        "watch",
        description="watch: follow repository changes through file-system events; poll: rescan every "
        "poll_interval_s; explicit: change only on RepositoryModelLoad/Unload, SIGHUP or `mpsd reload`; "
        "none: load at start only (SIGHUP still reconciles).",
    )
    model_upload_dir: Path | None = Field(
        None,
        description="Where model files sent with a load request (`file:` parameters) are kept while their "
        "model is loaded: the daemon makes a private folder of its own in it, removed at shutdown. Never "
        "inside the model repository. null: the system's temporary directory (TMPDIR).",
    )
    max_model_upload_bytes: Annotated[int, Field(ge=0)] = Field(
        256 * 1024 * 1024,
        description="Largest total of the model files one load request may send (`file:` parameters). "
        "0: loads with files are refused.",
    )
    reload_quiet_period_s: Annotated[float, Field(ge=0)] = Field(
        1.0, description="A repository change is acted on once files have been quiet this long."
    )
    poll_interval_s: Annotated[float, Field(gt=0)] = Field(2.0, description="Rescan interval in poll mode.")
    max_message_bytes: Annotated[int, Field(gt=0)] = Field(
        256 * 1024 * 1024,
        description="Largest gRPC message accepted or sent, and largest HTTP request body accepted; larger "
        "ones fail with RESOURCE_EXHAUSTED (HTTP: 413).",
    )
    front_processes: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="gRPC front processes sharing the TCP port (SO_REUSEPORT, Linux), so that gRPC's own "
        "work spreads over cores while batching and workers stay in the daemon. 0: the daemon serves "
        "gRPC itself. auto: 0 on macOS, on a Unix socket, on machines of at most 4 CPUs and beside "
        "front_ports; else one per 2 CPUs the daemon may run on, at most 8.",
    )
    front_ports: list[Annotated[int, Field(ge=1, le=65535)]] = Field(
        [],
        description="gRPC front processes that each listen on a port of their own on grpc_address's host, "
        "one per port, for clients that spread calls over them (gRPC's round_robin; mpsd.client "
        "front_target): more cores for gRPC where the port cannot be shared (macOS). The daemon still "
        "serves grpc_address itself. Not with front_processes above 0.",
    )
    front_arena_bytes: int = Field(
        64 << 20,
        ge=0,
        description="Shared memory per front process for large calls (requests and replies of 32 KiB or "
        "more), taken in full when the front starts. A call that finds its front's arena full goes through "
        "the front's socket, which costs the daemon's main thread a copy: 64 MiB holds about 200 calls of "
        "300 KB in flight. Where /dev/shm has no room for it, half as much is tried, down to 4 MiB, "
        "then none. 0: no arena.",
    )
    arenas_to_workers: bool = Field(
        True,
        description="Workers map the front processes' arenas and take large inputs of the calls that came "
        "through them from there themselves, so the daemon copies none of those bytes. The arenas hold every "
        "model's calls: with this on, a model's code can read other models' requests and replies. Turn it "
        "off where models must not see each other's data (models of different tenants in one daemon).",
    )
    event_loop: Literal["asyncio", "uvloop"] = Field(
        "asyncio",
        description="Event loop of the daemon and its front processes: asyncio's own, or uvloop (pip install "
        "'mpsd[uvloop]'), which costs less for small requests but measured slower with large ones.",
    )
    busy_poll_us: int = Field(
        default_factory=_default_busy_poll_us,
        ge=0,
        le=10000,
        description="Microseconds the daemon's and fronts' event loop keeps polling its sockets before it "
        "sleeps, after activity only (an idle loop sleeps at once): it catches a worker's answer and "
        "gRPC's next event without a wake-up, which cuts a small request's latency by about a quarter on a "
        "2-core machine, for up to this much CPU per sleep while requests come and go. 0: sleep at once "
        "(least CPU, for battery-powered Macs). Default 200; 0 on macOS, and where front processes run "
        "unless set (the daemon then reads a few links, many requests at a time). asyncio's loop only: "
        "uvloop does not poll.",
    )
    gather_us: int = Field(
        0,
        ge=0,
        le=10000,
        description="Microseconds the daemon's event loop waits before it sleeps while every instance of "
        "some model is full and its batches leave full, so that one pass reads the frames that arrive "
        "meanwhile instead of waking for each; a wait ends this long before a worker's answer is due, and "
        "at once when one comes. A request for another model waits up to this long. With ResNet-50 through "
        "front processes on the H200 host, 1000 took x0.77-0.86 of the daemon's CPU per image at 256 "
        "clients for the same images/s, and x1.00-1.01 the images/s at 64. 0: never (the default). "
        "asyncio's loop only.",
    )
    open_files: int = Field(
        DEFAULT_OPEN_FILES,
        ge=0,
        le=1 << 20,
        description="Soft open-file limit (RLIMIT_NOFILE) the daemon raises itself to at start, at most "
        "the hard limit (and OPEN_MAX, 10240, on macOS); never lowered. Every connection, worker socket and "
        "shared-memory region is a descriptor, and macOS starts processes with 256. 0: left as it is.",
    )
    prevent_idle_sleep: bool = Field(
        True,
        description="macOS: while it serves, the daemon keeps the Mac from idle sleep (a `caffeinate -i -w "
        "<daemon pid>` child), so it goes on answering when nobody uses the Mac. false: the Mac sleeps as "
        "its energy settings (pmset) say. No effect elsewhere.",
    )
    trace: TraceConfig = Field(
        default_factory=TraceConfig,
        description="Request tracing (OpenTelemetry) and Triton's trace settings; off unless `level` says.",
    )
    tls: TlsConfig | None = Field(
        None, description="Serve over TLS (cert_file, key_file; client_ca_file for mutual TLS)."
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="Bearer tokens and the RPC categories each may call."
    )
    allow_symlinks: bool = Field(
        False,
        description="Follow model, version and file symlinks that point outside the model repository "
        "(refused by default, with the reason shown in RepositoryIndex).",
    )
    op_library_dirs: list[Path] = Field(
        [],
        description="Directories outside the model folders from which models may load op libraries "
        "(`op_libraries`: shared objects and Python modules that register custom ops). A library is code "
        "the worker runs, so by default only the model's own folder may hold it.",
    )

    @field_validator("http_address", "openai_address", "metrics_address", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads a bare `off` (or `false`, `no`) as false: it means off, as the string does."""
        return "off" if value is False else value


def load_daemon_config(path: Path | None) -> DaemonConfig:
    """Read the daemon config; raises ConfigError with the file and field on any problem."""
    if path is None:
        return DaemonConfig()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        issue = Issue(str(path), (), "config file not found")
        raise ConfigError(str(issue), issues=(issue,)) from None
    except yaml.YAMLError as exc:
        issue = yaml_issue(path, exc)
        raise ConfigError(str(issue), issues=(issue,)) from None
    if not isinstance(raw, dict):
        issue = Issue(str(path), (), "expected a mapping of settings")
        raise ConfigError(str(issue), issues=(issue,))
    try:
        cfg = DaemonConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc), issues=validation_issues(path, exc)) from None
    if not cfg.model_repository.is_absolute():
        cfg.model_repository = (path.parent / cfg.model_repository).resolve()
    if cfg.model_upload_dir is not None and not cfg.model_upload_dir.is_absolute():
        cfg.model_upload_dir = (path.parent / cfg.model_upload_dir).resolve()
    cfg.op_library_dirs = [d if d.is_absolute() else (path.parent / d).resolve() for d in cfg.op_library_dirs]
    if cfg.tls is not None:
        cfg.tls.resolve(path.parent)
        cfg.tls.read()  # unreadable files are configuration errors, found before anything starts
    cfg.auth.resolve(path.parent)
    read_tokens(cfg.auth)
    return cfg
