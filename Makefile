# mpsd: `make run` starts the daemon on the example repository, `make test` runs the suite.

# Prints an interpreter's version, and fails for one older than 3.10.
PY_PROBE := 'import sys; print("%d.%d.%d" % sys.version_info[:3]); sys.exit(sys.version_info < (3, 10))'
# The Python the venv is made from: PY=... (on the command line or in the environment), else the newest of
# python3.13 to python3.10 on PATH that runs (a pyenv shim of a version not selected does not), else
# python3. A fresh Mac's python3 is Apple's 3.9, which pip refuses (requires-python >= 3.10), so python3
# comes last and is checked like any other.
ifeq ($(origin PY),undefined)
PY := $(or $(shell for p in python3.13 python3.12 python3.11 python3.10; do \
  command -v $$p >/dev/null && $$p -c $(PY_PROBE) >/dev/null 2>&1 && command -v $$p && break; done),python3)
endif
VENV := .venv
BIN := $(VENV)/bin
STAMP := .stamps
# The extras installed into .venv; the CI workflow adds `ci` (actionlint, fetched from GitHub while installing).
VENV_EXTRAS ?= test,dev
PROTOS := $(wildcard proto/mpsd/proto/*.proto)
GENERATED := $(PROTOS:proto/%.proto=%_pb2.py)
EXAMPLE_REPO := config/models
SYSTEM_TOOLS := plistutil h2load haproxy chromium chromedriver
BREW_TOOLS := brew install libplist nghttp2 haproxy && brew install --cask chromium chromedriver
# The version of the venv's Python when it is too old or does not run (a venv made by Apple's 3.9, which
# pip refused to fill): that venv is made again rather than kept. Empty when it is fine or absent.
VENV_OLD := $(shell if [ -e $(BIN)/python ] || [ -L $(BIN)/python ]; then \
  v=$$($(BIN)/python -c $(PY_PROBE) 2>/dev/null) || echo "$${v:-unusable}"; fi)

.PHONY: install run test lint bench proto models clean system-tools check-python FORCE

install: $(STAMP)/venv proto system-tools

# Refuses a Python older than 3.10 before anything is made, saying what to do, on one line.
check-python:
	@v=$$($(PY) -c $(PY_PROBE) 2>/dev/null) || { echo "mpsd needs Python 3.10 or newer and $(PY) is \
	$${v:-not a working Python}: install one (macOS: brew install python@3.12) and run make again, or name it: \
	make PY=/path/to/python3.12" >&2; exit 1; }; echo "Python $$v: $(PY)"

$(STAMP)/venv: pyproject.toml constraints-cpu.txt $(if $(VENV_OLD),FORCE) | check-python
	@if [ -n "$(VENV_OLD)" ]; then echo "$(VENV)'s Python is $(VENV_OLD), not 3.10 or newer: making it again"; \
	  rm -rf $(VENV); fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[$(VENV_EXTRAS)]'
	@mkdir -p $(STAMP) && touch $@

# Generated gRPC code lives next to the package and is never edited by hand.
proto: $(STAMP)/venv $(GENERATED)

mpsd/proto/%_pb2.py: proto/mpsd/proto/%.proto $(STAMP)/venv
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch mpsd/proto/__init__.py

# Tools some tests use as independent checks (plist parser, HTTP/2 load generator), the load balancer
# the scale-out tests put in front of several daemons, and the browser (Debian's Chromium and its
# WebDriver) that loads the status page. On macOS, Homebrew has them: make names the command and goes on.
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(uname -s)" = Darwin ]; then \
	    echo "not installed:$$missing (tests that need them will skip); to install them: $(BREW_TOOLS)"; \
	  elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
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

# Beyond ruff, mypy, the import contracts and vulture: the size limits (400 lines a module of the daemon, the
# worker and config; 60 lines a function) and import cycles, which tests/test_architecture.py checks.
lint: install
	$(BIN)/ruff check mpsd tests bench
	$(BIN)/ruff format --check mpsd tests bench
	$(BIN)/mypy mpsd
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_architecture.py -k "small or short or cycles"

# Overhead benchmarks (bench/README.md); figures land in bench/results/. BENCH_ARGS=--quick: a smoke run.
bench: install
	$(BIN)/python -m bench.run $(BENCH_ARGS)
	$(BIN)/python -m bench.residency --out bench/results $(if $(findstring --quick,$(BENCH_ARGS)),--seconds 3 --name residency-quick,)

FORCE:

clean:
	rm -rf $(VENV) $(STAMP) mpsd/proto/*_pb2*.py mpsd/proto/*_pb2*.pyi
