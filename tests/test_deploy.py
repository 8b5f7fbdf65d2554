"""The deployment files under deploy/: KServe's ServingRuntimes against KServe's own CRD schema (strict: an
unknown field is an error, as `kubectl apply --validate=strict` makes it) and what KServe expects beyond
it, the Dockerfile's instructions against the repository, and the HAProxy configuration's syntax."""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from mpsd.cli import build_parser
from tests.conftest import ROOT
from tests.os_skips import not_installed

KSERVE = ROOT / "deploy" / "kserve"
RUNTIMES = list(yaml.safe_load_all((KSERVE / "servingruntime.yaml").read_text()))
DOCKERFILE = KSERVE / "Dockerfile"


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the fields of an object (Kubernetes
    prunes them silently, which hides a misspelt field)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = strict(json.loads((KSERVE / "servingruntime.schema.json").read_text()))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def errors(validator: jsonschema.protocols.Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_servingruntimes_are_valid_kserve_resources(validator: jsonschema.protocols.Validator) -> None:
    assert [r["metadata"]["name"] for r in RUNTIMES] == ["mpsd", "mpsd-grpc"]
    for runtime in RUNTIMES:
        assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1", "ServingRuntime")
        assert errors(validator, runtime) == [], runtime["metadata"]["name"]


def test_the_schema_refuses_what_kserve_would_not_take(validator: jsonschema.protocols.Validator) -> None:
    """The check can fail: a misspelt field, a wrong type and a missing container are errors."""
    misspelt = copy.deepcopy(RUNTIMES[0])
    misspelt["spec"]["supportedModelFormats"][0]["autoselect"] = True
    wrong_type = copy.deepcopy(RUNTIMES[0])
    wrong_type["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    no_containers = copy.deepcopy(RUNTIMES[0])
    del no_containers["spec"]["containers"]
    for broken in (misspelt, wrong_type, no_containers):
        assert errors(validator, broken) != []


def test_servingruntimes_are_what_kserve_expects() -> None:
    """Beyond the schema: KServe's container name, one port named for the protocol Knative routes
    (http1 for HTTP, h2c for gRPC), both KServe v2 protocols, the repository at /mnt/models, and
    arguments `mpsd serve` accepts, listening where the ports and probes say."""
    parser = build_parser()
    for runtime, (port_name, port) in zip(RUNTIMES, [("http1", 8080), ("h2c", 9000)], strict=True):
        spec = runtime["spec"]
        assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
        assert spec["annotations"]["prometheus.kserve.io/port"] == "8002"
        (container,) = spec["containers"]
        assert container["name"] == "kserve-container"
        assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [(port_name, port)]
        args = parser.parse_args(container["args"])
        assert args.model_repository == Path("/mnt/models")
        assert (args.http_address, args.grpc_address, args.metrics_address) == (
            "0.0.0.0:8080",
            "0.0.0.0:9000",
            "0.0.0.0:8002",
        )
        assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
        assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
        assert any(f["autoSelect"] for f in spec["supportedModelFormats"]) == (runtime is RUNTIMES[0])


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a continuation"
    return out


KNOWN = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "STOPSIGNAL", "ENTRYPOINT", "CMD"}


def test_dockerfile_parses_and_copies_files_that_exist() -> None:
    steps = instructions(DOCKERFILE.read_text())
    assert {k for k, _ in steps} <= KNOWN, {k for k, _ in steps} - KNOWN
    assert next(k for k, _ in steps if k != "ARG") == "FROM"
    copies = [shlex.split(a) for k, a in steps if k == "COPY"]
    assert copies
    for *sources, _destination in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["mpsd"]
    cmd = json.loads(dict(steps)["CMD"])
    assert cmd == RUNTIMES[0]["spec"]["containers"][0]["args"]  # the image alone serves as KServe runs it
    build_parser().parse_args(cmd)
    exposed = {int(p) for p in dict(steps)["EXPOSE"].split()}
    assert exposed == {8080, 9000, 8002}
    assert dict(steps)["USER"] not in ("0", "root")
    # the generated gRPC modules are made in the image: they are not in the repository
    assert any("grpc_tools.protoc" in a for k, a in steps if k == "RUN")


def haproxy_env(daemons: int) -> dict[str, str]:
    env = {f"MPSD{n}_HOST": "127.0.0.1" for n in range(1, daemons + 1)}
    env |= {f"MPSD{n}_GRPC_PORT": str(9000 + n) for n in range(1, daemons + 1)}
    env |= {f"MPSD{n}_HTTP_PORT": str(8000 + n) for n in range(1, daemons + 1)}
    return env | {"MPSD_GRPC_BIND": ":8001", "MPSD_HTTP_BIND": ":8000", "MPSD_STATS_BIND": "127.0.0.1:8404"}


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=not_installed("haproxy"))
@pytest.mark.parametrize("daemons", [1, 2, 3, 4])
def test_haproxy_config_is_valid(daemons: int, tmp_path: Path) -> None:
    """deploy/haproxy/mpsd.cfg as it is (3 daemons), and written for other counts (bench/haproxy.py)."""
    from bench.haproxy import CONFIG, haproxy_config

    config = CONFIG
    if daemons != 3:
        config = tmp_path / "mpsd.cfg"
        config.write_text(haproxy_config(daemons))
    check = subprocess.run(
        ["haproxy", "-c", "-f", str(config)],
        env={**os.environ, **haproxy_env(daemons)},
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_haproxy_config_for_other_daemon_counts() -> None:
    """Backends that list every daemon list every daemon of the count; the one for a model only some
    daemons serve keeps its subset; the template's own count gives the file unchanged."""
    from bench.haproxy import CONFIG, haproxy_config

    assert haproxy_config(3) == CONFIG.read_text()
    four = haproxy_config(4)
    assert 'server mpsd4 "${MPSD4_HOST}:${MPSD4_GRPC_PORT}" proto h2 track mpsd_http/mpsd4\n' in four
    assert 'server mpsd4 "${MPSD4_HOST}:${MPSD4_HTTP_PORT}" check\n' in four
    assert (
        four.count("server mpsd4") == 2
        and four.count("server mpsd3") == 2
        and four.count("server mpsd1") == 3
    )
    one = haproxy_config(1)
    assert one.count("server mpsd1") == 3 and "server mpsd2" not in one and "MPSD2_" not in one
    with pytest.raises(ValueError):
        haproxy_config(0)
