# Each target installs what it needs; `make test` is what CI runs.
SHELL := /bin/bash
export UV_PYTHON_DOWNLOADS := never
UV ?= $(shell command -v uv 2>/dev/null || echo "python3.12 -m uv")
VENV_STAMP := .venv/.synced

.PHONY: install demo serve test lint format

$(VENV_STAMP): pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || python3.12 -m uv --version >/dev/null 2>&1 || python3.12 -m pip install --quiet uv
	$(UV) sync --locked --all-extras
	@touch $(VENV_STAMP)

install: $(VENV_STAMP)

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

test: lint
	$(UV) run --no-sync pytest $(PYTEST_ARGS)
