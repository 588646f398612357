# Two commands on a fresh machine: `make demo` and `make test`. Each creates its environment if missing.
PYTHON ?= python3
VENV ?= .venv
# torch first, pinned: on this project's CPU machines it resolves to the local CPU build; elsewhere to PyPI's build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# DeepSpeed JIT-compiles ops on first use; keep them with the environment that built them.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions

.PHONY: demo test test-fast bench clean-runs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	# The deepspeed extra, without prebuilt ops (CPU here; the CUDA image builds them): its setup imports torch.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.15"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/rlaif run --config configs/demo.yaml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

# Peers (TRL) live only in the benchmark environment. Benchmarks read the labels of a finished demo run.
.venv-bench/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/pip install -q "$(TORCH_SPEC)"
	.venv-bench/bin/pip install -q -e . "trl==1.16.0" datasets
	touch $@

bench: .venv-bench/.installed
	test -f runs/demo/label/manifest.json || $(MAKE) demo
	.venv-bench/bin/python bench/bench_reward_model.py --source-run runs/demo --trials 3

clean-runs:
	rm -rf runs
