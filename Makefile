# Two commands set up a fresh machine: `make demo` and `make test` (each builds .venv first if needed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 from PyPI is a CUDA build on Linux x86_64; on machines with a local CPU wheel it takes that.
# Override for another build, e.g. `make test TORCH="torch==2.5.1"`.
TORCH ?= torch==2.13.0
# DeepSpeed for the ZeRO tests (they run it on the CPU). Its setup.py imports torch, so it builds without isolation.
DEEPSPEED ?= deepspeed==0.19.8
STAMP := $(VENV)/.installed

.PHONY: demo test benchmark clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[test]"
	$(BIN)/pip install --quiet --disable-pip-version-check "setuptools>=69"
	$(BIN)/pip install --quiet --disable-pip-version-check --no-build-isolation "$(DEEPSPEED)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

benchmark: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs lightning_logs .mypy_cache .ruff_cache .pytest_cache
