# mpsd: `make run` starts the daemon on the example repository, `make test` runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := .stamps
PROTOS := $(wildcard proto/mpsd/proto/*.proto)
GENERATED := $(PROTOS:proto/%.proto=%_pb2.py)
EXAMPLE_REPO := config/models
SYSTEM_TOOLS := plistutil h2load haproxy chromium chromedriver

.PHONY: install run test lint bench proto models clean system-tools

install: $(STAMP)/venv proto system-tools

$(STAMP)/venv: pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[test,dev]'
	@mkdir -p $(STAMP) && touch $@

# Generated gRPC code lives next to the package and is never edited by hand.
proto: $(STAMP)/venv $(GENERATED)

mpsd/proto/%_pb2.py: proto/mpsd/proto/%.proto $(STAMP)/venv
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch mpsd/proto/__init__.py

# Tools some tests use as independent checks (plist parser, HTTP/2 load generator), the load balancer
# the scale-out tests put in front of several daemons, and the browser (Debian's Chromium and its
# WebDriver) that loads the status page.
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libplist-utils nghttp2-client haproxy chromium chromium-driver >/dev/null) \
	      || echo "could not install$$missing; tests that need them will skip"; \
	  else echo "not installed:$$missing (tests that need them will skip)"; fi; \
	fi

models: install
	$(BIN)/python -m mpsd.examples $(EXAMPLE_REPO)

run: models
	$(BIN)/mpsd serve --config config/mpsd.yaml

# Test modules run side by side (pytest-xdist), one more at a time than there are cores and at most 4: much
# of a test's time is spent waiting for the processes it starts. A module and the daemons it shares stay in
# one process (--dist loadfile).
TEST_WORKERS = $(shell $(PY) -c 'import os; print(min(4, (os.cpu_count() or 1) + 1))')
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

lint: install
	$(BIN)/ruff check mpsd tests bench
	$(BIN)/ruff format --check mpsd tests bench
	$(BIN)/mypy mpsd
	$(BIN)/lint-imports

# Overhead benchmarks (bench/README.md); figures land in bench/results/. BENCH_ARGS=--quick: a smoke run.
bench: install
	$(BIN)/python -m bench.run $(BENCH_ARGS)
	$(BIN)/python -m bench.residency --out bench/results $(if $(findstring --quick,$(BENCH_ARGS)),--seconds 3 --name residency-quick,)

clean:
	rm -rf $(VENV) $(STAMP) mpsd/proto/*_pb2*.py mpsd/proto/*_pb2*.pyi
