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

.PHONY: demo test test-fast test-timing test-fake-cuda benchmark gpu-check clean

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

# The suite runs on every core (pytest-xdist); `make test PYTEST_PARALLEL=` runs it in one process, as does
# `$(BIN)/python -m pytest tests/test_x.py` for one file. `--dist loadfile` keeps each file's tests on one worker: the
# multi-process tests (tests/test_distributed.py, which start their own processes) run one at a time, and a module
# fixture trains once. (`--dist loadgroup` would be finer, but pytest-xdist 3.8 cannot group under pytest 9.2:
# pytest-dev/pytest-xdist#1386.) `--no-loadscope-reorder` hands out the files in the order tests/conftest.py sorts them,
# the longest first (multi-process, then replay); pytest-xdist's own order (most tests first) put files of few but long
# tests (tests/test_distributed_replay.py, one-test replay files) late, one worker busy with them while the other idled.
PYTEST_PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder

# `--durations=30`: the slowest tests end the output, where CI's log shows where the suite's time goes.
# mypy (one process, about 45 s uncached) runs beside pytest rather than before it: alone it leaves a core idle. Its
# output is printed after pytest's; the target fails if either fails.
MYPY_LOG := $(VENV)/mypy.log
test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy > $(MYPY_LOG) 2>&1 & mypy_pid=$$!; \
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not timing" --durations=30; pytest_rc=$$?; \
	wait $$mypy_pid; mypy_rc=$$?; \
	echo "mypy:"; cat $(MYPY_LOG); \
	test $$pytest_rc -eq 0 && test $$mypy_rc -eq 0

# The inner loop: everything but the multi-process tests and the replay tier (CI and `make test` run all).
# Tests marked `replay` read what the replay under fake tensors predicts, and replay every change it could advise:
# `$(BIN)/python -m pytest -m replay` runs that tier alone (tests/conftest.py turns replays off in every other test).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not distributed and not replay and not timing"

# The step-time check (issue 26): the predicted step time against the measured one, within 25%, on this CPU. It
# asserts on measured durations, so neither `make test` nor CI runs it (a loaded machine would fail it); it runs in
# one process, on a machine left otherwise idle.
test-timing: $(TEST_STAMP)
	$(BIN)/python -m pytest -m timing -s

# Replays on fake CUDA tensors without a GPU (docs/fake-cuda.md): a CUDA build of torch in a venv of its own (about
# 5.5 GB, no GPU needed), and the tests marked fake_cuda, which the default CPU build skips. Not part of `make test`.
FAKE_CUDA_VENV := .venv-fake-cuda
FAKE_CUDA_TORCH ?= torch==2.14.1
FAKE_CUDA_STAMP := $(FAKE_CUDA_VENV)/.installed

$(FAKE_CUDA_STAMP): pyproject.toml
	$(PYTHON) -m venv $(FAKE_CUDA_VENV)
	$(FAKE_CUDA_VENV)/bin/pip install --quiet --disable-pip-version-check "$(FAKE_CUDA_TORCH)"
	$(FAKE_CUDA_VENV)/bin/pip install --quiet --disable-pip-version-check -e ".[test]" "$(FAKE_CUDA_TORCH)"
	$(FAKE_CUDA_VENV)/bin/python -c "import torch; assert torch.backends.cuda.is_built(), 'not a CUDA build of torch'"
	touch $(FAKE_CUDA_STAMP)

test-fake-cuda: $(FAKE_CUDA_STAMP)
	$(FAKE_CUDA_VENV)/bin/python -m pytest tests/test_fake_cuda.py tests/test_replay_predict.py tests/test_attention_flops.py

benchmark: $(TEST_STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/hot_path.py

# On a machine with a CUDA GPU: the GPU tests, the overhead benchmark, per-phase peaks, the largest batch and
# preflight's remedies trained for real, in one table (under 8 minutes; docs/gpu-validation.md).
gpu-check: $(TEST_STAMP)
	$(BIN)/python scripts/gpu_check.py --out docs/gpu-validation-run.md

clean:
	rm -rf $(VENV) $(FAKE_CUDA_VENV) runs lightning_logs .mypy_cache .ruff_cache .pytest_cache
