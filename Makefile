# Each target installs what it needs; `make test` is what CI runs.
SHELL := /bin/bash
export UV_PYTHON_DOWNLOADS := never
UV ?= $(shell command -v uv 2>/dev/null || echo "python3.12 -m uv")
VENV_STAMP := .venv/.synced

.PHONY: install system-deps demo serve test lint format

$(VENV_STAMP): pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || python3.12 -m uv --version >/dev/null 2>&1 || python3.12 -m pip install --quiet uv
	$(UV) sync --locked --all-extras
	@touch $(VENV_STAMP)

install: $(VENV_STAMP)

# Test-only system packages: a PostgreSQL server for the database tests, Chromium for the dashboard test.
system-deps:
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	  else echo "note:$$missing not installed; those tests will be skipped"; fi; \
	fi

demo: install
	$(UV) run --no-sync tputune demo

serve: install
	$(UV) run --no-sync tputune serve

lint: install
	$(UV) run --no-sync ruff check .
	$(UV) run --no-sync ruff format --check .
	$(UV) run --no-sync mypy

format: install
	$(UV) run --no-sync ruff format .
	$(UV) run --no-sync ruff check --fix .

# Two test processes (the 2 cores of CI: 13.7 min, not 19.5); the training tests one after another in
# one of them (tests/conftest.py). `make test PYTEST_ARGS=-n0` runs them all in one.
PYTEST_ARGS ?= -n 2
test: lint system-deps
	$(UV) run --no-sync pytest $(PYTEST_ARGS)
