# Every target sets up what it needs and no more: the venv in .venv (with the CPU build
# of torch, so no CUDA wheels are pulled) for all; the dev extra in it for the tests and
# linters; Azurite in node_modules for the benchmarks on it; the full test run also
# Debian's chromium and HAProxy.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STORAGE ?= local:.rallypoint
PORT ?= 8080

.PHONY: setup venv dev frameworks azurite browser balancer test test-fast test-frameworks lint typecheck serve demo bench-storage bench-rendezvous bench-checkpoint bench-recovery bench-tiers bench-resume bench-export clean

# What `make test` needs: everything below.
setup: dev frameworks azurite browser balancer

# The package with every extra: what the demo, the coordinator and the benchmarks run.
venv: $(VENV)/.installed

# The same venv with the tools the tests and linters use (the dev extra).
dev: $(VENV)/.dev

# DeepSpeed for its integration's tests: built from source without its C++/CUDA ops
# (DS_BUILD_OPS=0; they compile on first use, and the CPU tests use none) and without
# build isolation (its setup imports torch). Lightning and transformers come with dev.
frameworks: $(VENV)/.frameworks

azurite: node_modules/.installed

# Debian's Chromium and ChromeDriver, for the status page's test (apt, as root or sudo).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

# Debian's HAProxy, the load balancer in front of the replicas in tests/e2e/test_failover.py.
balancer:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; }

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[all]'
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[all,dev]'
	touch $@

$(VENV)/.frameworks: $(VENV)/.dev
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation 'deepspeed>=0.19.8'
	# On a CPU, deepspeed.initialize compiles its shared-memory collectives on first use
	# (minutes, into ~/.cache/torch_extensions): once here, not inside a timed test, where
	# a build killed half-way would leave a lock every later start waits on forever.
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
	  a().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/check-links

typecheck: dev
	PATH=$(abspath $(BIN)):$$PATH scripts/typecheck

# The unit and azurite lanes wait more than they compute (35% of 2 CPUs busy serially):
# on two xdist workers they took 3:07 against 5:15. The e2e lane runs serially: it is
# bound by CPU, so two workers (worksteal, the `alone` tests after them) gained little
# (36:33 + 1:14 at a2db406, 33:39 + the alone tests at 3838c76, against 40:43-43:10
# serially), and the second of those runs failed 2 tests under the load
# (docs/ARCHITECTURE.md, "Tests").
test: setup lint typecheck
	$(BIN)/python -m pytest -m "not e2e" -n 2
	$(BIN)/python -m pytest -m e2e

# The unit lane: tests that start no process (tests/conftest.py says which are which).
test-fast: dev
	$(BIN)/python -m pytest -m unit -n 2

# The framework integrations' tests alone (part of `make test` too).
test-frameworks: dev frameworks
	$(BIN)/python -m pytest tests/trainer/test_lightning*.py tests/trainer/test_transformers*.py \
	  tests/trainer/test_deepspeed*.py

serve: venv
	$(BIN)/rallypoint serve --storage $(STORAGE) --port $(PORT)

demo: venv
	$(BIN)/rallypoint demo

bench-storage: venv azurite
	$(BIN)/python bench/storage.py

bench-rendezvous: venv azurite
	$(BIN)/python bench/rendezvous.py

bench-checkpoint: venv azurite
	$(BIN)/python bench/checkpoint.py

bench-recovery: venv
	$(BIN)/python bench/recovery.py

bench-tiers: venv
	$(BIN)/python bench/tiers.py

bench-resume: venv
	$(BIN)/python bench/resume_position.py

bench-export: venv
	$(BIN)/python bench/export.py

clean:
	rm -rf $(VENV) node_modules build .rallypoint .pytest_cache .mypy_cache .ruff_cache
