# Two commands set up a fresh machine: `make demo` and `make test` (each builds .venv first with what it needs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --disable-pip-version-check
# torch==2.13.0 from PyPI is a CUDA build on Linux x86_64; on machines with a local CPU wheel it takes that.
# Override for another build, e.g. `make test TORCH="torch==2.5.1"`.
TORCH ?= torch==2.13.0
# DeepSpeed for the ZeRO tests only (they run it on the CPU). Its setup.py imports torch: no build isolation.
DEEPSPEED ?= deepspeed==0.19.8
DEMO_STAMP := $(VENV)/.demo-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: demo test test-fast benchmark clean

# The demo needs torch, the package and rich (the console table): nothing the tests alone need.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[rich]"
	touch $(DEMO_STAMP)

$(TEST_STAMP): $(DEMO_STAMP) pyproject.toml
	$(PIP) -e ".[test]"
	$(PIP) "setuptools>=69"
	$(PIP) --no-build-isolation "$(DEEPSPEED)"
	touch $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/quickstart.py

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

# The inner loop: everything but the multi-process tests and the replay tier (CI and `make test` run all).
# Tests marked `replay` read what the replay under fake tensors predicts, and replay every change it could advise:
# `$(BIN)/python -m pytest -m replay` runs that tier alone (tests/conftest.py turns replays off in every other test).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not distributed and not replay"

benchmark: $(TEST_STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/hot_path.py

clean:
	rm -rf $(VENV) runs lightning_logs .mypy_cache .ruff_cache .pytest_cache
