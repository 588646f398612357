"""Errors a user can cause: one line, exit code 2, no traceback, nothing written that a later stage would trust."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def rlaif(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "rlaif", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_clean_failure(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_config_key(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set", "ppo.learning_rate=1")
    assert_clean_failure(proc, "unknown config key 'ppo.learning_rate'")
    assert list(tmp_path.iterdir()) == []


def test_missing_prompts_file(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set", "data.prompts=missing.jsonl")
    assert_clean_failure(proc, "prompts file not found: missing.jsonl")
    assert not list(tmp_path.rglob("manifest.json"))


def test_unwritable_storage_root(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", f"file://{blocker}/runs")
    assert_clean_failure(proc, "is not writable")


def test_unsupported_storage_scheme():
    assert_clean_failure(rlaif("run", "--storage-root", "gs://bucket/x"), "only file:// and s3://")


def test_stage_without_its_input(tmp_path):
    proc = rlaif("stage", "label", "--config", "configs/tiny.yaml", "--set", f"storage.root={tmp_path}")
    assert_clean_failure(proc, "run stage 'generate' first")


@pytest.mark.parametrize("args", [["graph"], ["--help"]])
def test_graph_and_help(args):
    proc = rlaif(*args)
    assert proc.returncode == 0 and ("generate" in proc.stdout)


def test_launch_refuses_bad_overrides_json(tmp_path):
    proc = rlaif("launch", "generate", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path),
                 "--set-json", "ppo.lr=1")
    assert_clean_failure(proc, "--set-json must be a JSON list of KEY=VALUE strings")
    assert list(tmp_path.iterdir()) == []


def test_launch_of_a_stage_whose_input_is_missing(tmp_path):
    proc = rlaif("launch", "label", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path))
    assert_clean_failure(proc, "generate")
    assert not list(tmp_path.rglob("manifest.json"))


def test_multinode_stage_outside_a_cluster(tmp_path):
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", str(tmp_path), "--set", "train_rm.nodes=2")
    assert_clean_failure(proc, "train_rm.nodes=2 needs a Kubernetes cluster")
    assert not list(tmp_path.rglob("manifest.json"))
