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

.PHONY: venv services services-down demo test lint unit bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $@

services: venv
ifeq ($(USE_EXTERNAL),)
	@$(SERVICES) up
endif

services-down:
	@$(SERVICES) down

define with_env
$(if $(USE_EXTERNAL),,eval "$$($(SERVICES) env)";)
endef

# KEEP=1 (or DEMO_ARGS=--keep) leaves the local services running for exploration.
demo: services
	@$(with_env) $(VENV)/bin/kvledger demo $(DEMO_ARGS) $(if $(KEEP),--keep,)
	@if [ -z "$(KEEP)$(USE_EXTERNAL)" ] && ! echo "$(DEMO_ARGS)" | grep -q -- --keep; then \
		$(SERVICES) down; fi

lint: venv
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy

unit: venv
	@$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

test: lint services
	@$(with_env) $(PY) -m pytest $(PYTEST_ARGS)

bench: services
	@$(with_env) $(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
