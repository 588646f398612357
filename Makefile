# Two commands on a fresh machine: `make demo` and `make test`. Each creates its environment if missing.
PYTHON ?= python3
VENV ?= .venv
# torch first, pinned: on this project's CPU machines it resolves to the local CPU build; elsewhere to PyPI's build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The demo and the tests never download models: hub ids resolve only from the Hugging Face cache.
export HF_HUB_OFFLINE ?= 1
# DeepSpeed JIT-compiles ops on first use; keep them with the environment that built them.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions

.PHONY: demo demo-seeds test test-fast test-airflow lint pipeline bench clean-runs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,kfp,datasets,tracking,serve]"
	# The deepspeed extra, without prebuilt ops (CPU here; the CUDA image builds them): its setup imports torch.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.15"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/rlaif run --config configs/demo.yaml

# The demo on seeds 0 (= `make demo`), 1 and 2: records docs/demo_results.json and the tables in README and BENCHMARKS.
demo-seeds: $(VENV)/.installed
	$(BIN)/python scripts/demo_seeds.py --seeds 0 1 2

# Airflow lives in its own environment (its Kubernetes provider and kfp disagree on `kubernetes`); the DAGs there
# import only rlaif's standard-library modules, and the local DAG's tasks run this project's `rlaif` from $(VENV).
AIRFLOW_VENV ?= .venv-airflow
$(AIRFLOW_VENV)/.deps: dags/requirements-airflow.txt
	$(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install -q --upgrade pip
	$(AIRFLOW_VENV)/bin/pip install -q -r dags/requirements-airflow.txt "pytest>=8"
	touch $@

# After $(VENV): two editable installs at once would both write rlaif.egg-info in this folder.
$(AIRFLOW_VENV)/.installed: $(AIRFLOW_VENV)/.deps $(VENV)/.installed pyproject.toml
	$(AIRFLOW_VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The two environments install side by side (234 s against 281 s one after the other: a fresh clone on a 2-core
# machine, 2026-11-29). The stage processes the tests start import rlaif afresh each: its bytecode is compiled once
# here, for environments that set PYTHONDONTWRITEBYTECODE. (--output-sync: GNU make 4.0 and later.)
OUTPUT_SYNC := $(if $(filter output-sync,$(.FEATURES)),--output-sync=target)
test:
	$(MAKE) --no-print-directory -j2 $(OUTPUT_SYNC) $(VENV)/.installed $(AIRFLOW_VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q rlaif components
	$(BIN)/python -m pytest -q --durations=25 tests components --ignore=tests/airflow
	RLAIF_BIN=$(abspath $(BIN))/rlaif $(AIRFLOW_VENV)/bin/python -m pytest -q tests/airflow

test-airflow: $(VENV)/.installed $(AIRFLOW_VENV)/.installed
	RLAIF_BIN=$(abspath $(BIN))/rlaif $(AIRFLOW_VENV)/bin/python -m pytest -q tests/airflow

# Recompile the checked-in Kubeflow pipeline and component YAMLs (a test fails when they are stale).
pipeline: $(VENV)/.installed
	$(BIN)/python pipelines/rlaif_pipeline.py --output pipelines/rlaif_pipeline.yaml --components-dir components

test-fast: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" tests components --ignore=tests/airflow

lint: $(VENV)/.installed
	$(BIN)/ruff check .

# Peers (TRL) live only in the benchmark environments: TRL 1.16 for RewardTrainer, TRL 1.12.0 (the last release with
# PPOTrainer) for PPO. The reward-model benchmark reads the labels of a finished demo run.
.venv-bench/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-bench
	.venv-bench/bin/pip install -q "$(TORCH_SPEC)"
	.venv-bench/bin/pip install -q -e . "trl==1.16.0" datasets
	touch $@

.venv-bench-ppo/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-bench-ppo
	.venv-bench-ppo/bin/pip install -q "$(TORCH_SPEC)"
	.venv-bench-ppo/bin/pip install -q -e . "trl==1.12.0" datasets
	touch $@

bench: $(VENV)/.installed .venv-bench/.installed .venv-bench-ppo/.installed
	$(BIN)/python bench/bench_gae.py --append
	$(BIN)/python bench/bench_generation.py --append
	$(BIN)/python bench/bench_label.py --append
	$(BIN)/python bench/bench_judge_agreement.py --append
	$(BIN)/python bench/bench_ppo_update.py --append
	$(BIN)/python bench/bench_ppo_scaling.py --append
	$(BIN)/python bench/bench_shards.py --append
	.venv-bench-ppo/bin/python bench/bench_ppo.py --trials 3 --iterations 6
	.venv-bench/bin/python bench/bench_grpo.py --trials 3 --iterations 6
	test -f runs/demo/label/manifest.json || $(MAKE) demo
	.venv-bench/bin/python bench/bench_reward_model.py --source-run runs/demo --trials 3

clean-runs:
	rm -rf runs
