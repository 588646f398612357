# Two commands on a fresh machine: `make demo` and `make test`. Each creates its environment if missing.
PYTHON ?= python3
VENV ?= .venv
# torch first, pinned: on this project's CPU machines it resolves to the local CPU build; elsewhere to PyPI's build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-fast clean-runs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/rlaif run --config configs/demo.yaml

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

clean-runs:
	rm -rf runs
