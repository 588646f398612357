"""The whole pipeline on the tiny config, as real processes (torchrun for the training stages)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlaif.config import load_config
from rlaif.graph import STAGES
from rlaif.io import manifest, shards, storage
from rlaif.stages.common import run_url

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
METRIC_KEYS = {"win_rate", "win_rate_ci95", "n_prompts", "reward_policy_mean", "reward_reference_mean",
               "kl_to_reference", "win_rate_length_controlled", "judges"}


def rlaif(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "rlaif", *args], cwd=REPO, env=env or os.environ.copy(),
                          capture_output=True, text=True, **kw)


def verify_run(cfg):
    """Every stage manifest exists, every shard passes its checksum, every listed file matches its sha256."""
    storage.configure(cfg.storage.endpoint_url)
    base = run_url(cfg)
    for stage in STAGES:
        url = storage.join(base, stage.name)
        m = manifest.require(url, stage.name)
        assert m["digest"] == manifest.digest(m)
        assert len(shards.read_all(url, m)) == m["num_samples"] if m["shards"] else True
        for f in m["files"]:
            import hashlib

            assert hashlib.sha256(storage.read_bytes(storage.join(url, f["path"]))).hexdigest() == f["sha256"]
    return json.loads(storage.read_text(storage.join(base, "evaluate", "metrics.json")))


def check_metrics(metrics, cfg):
    assert METRIC_KEYS <= set(metrics)
    lo, hi = metrics["win_rate_ci95"]
    assert 0 <= lo <= metrics["win_rate"] <= hi <= 1 and metrics["n_prompts"] == 16
    # The shipped prompts carry key points, so the reference judge grades beside the configured ones
    assert set(metrics["judges"]) == {"training", "heldout", "reference"}
    assert metrics["judges"]["reference"]["judge"] == "reference"
    diversity = metrics["diversity"]
    assert 1 / 16 <= diversity["top_response_share"] <= 1 and 0 < diversity["distinct_2"] <= 1
    assert 0 <= metrics["eos_rate_policy"] <= 1
    label = manifest.require(storage.join(run_url(cfg), "label"), "label")
    agreement = json.loads(storage.read_text(storage.join(run_url(cfg), "label", "metrics.json")))
    assert agreement == json.loads(json.dumps(label["summary"]))
    assert "metrics.json" in [f["path"] for f in label["files"]]
    assert agreement["reference_graded_pairs"] == agreement["pairs_judged"] == 32
    assert agreement["reference_clear_pairs"] == 0 or 0 <= agreement["reference_agreement"] <= 1
    rm = manifest.require(storage.join(run_url(cfg), "train_rm"), "train_rm")["summary"]
    assert rm["held_out_reference_pairs"] == 0 or 0 <= rm["held_out_reference_accuracy"] <= 1
    assert metrics["upstream"]["label_reference_agreement"] == agreement["reference_agreement"]


def test_file_storage_run_then_cache_hits(tmp_path):
    root = f"file://{tmp_path}/runs"
    first = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"run_dir: {root}/tiny" in first.stdout and "report: " in first.stdout
    for stage in STAGES:
        assert f"[{stage.name}] running" in first.stdout
    cfg = load_config("configs/tiny.yaml", [f"storage.root={root}"])
    check_metrics(verify_run(cfg), cfg)
    assert (tmp_path / "runs/tiny/evaluate/report.html").read_text().startswith("<!doctype html>")
    assert (tmp_path / "runs/tiny/ppo/reward_kl.png").stat().st_size > 1000
    assert (tmp_path / "runs/tiny/ppo/policy/model.safetensors").exists()

    second = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "running" not in second.stdout
    assert second.stdout.count("cache hit") == len(STAGES)

    # A changed PPO setting re-runs ppo and evaluate only.
    third = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.lr=2e-3", timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert [s.name for s in STAGES if f"[{s.name}] running" in third.stdout] == ["ppo", "evaluate"]

    # A quality gate that fails: exit 2 with the reason, the report shows it, and no evaluate manifest is written.
    gated = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.lr=2e-3",
                  "--set", "evaluate.min_win_rate=1", timeout=600)
    assert gated.returncode == 2 and "quality gate failed: win rate" in gated.stderr
    assert not (tmp_path / "runs/tiny/evaluate/manifest.json").exists()
    assert 'class="fail"' in (tmp_path / "runs/tiny/evaluate/report.html").read_text()

    rebuilt = rlaif("report", f"{tmp_path}/runs/tiny", timeout=120)
    assert rebuilt.returncode == 0 and "report: " in rebuilt.stdout
    compared = rlaif("report", f"{tmp_path}/runs/tiny", f"{tmp_path}/runs/tiny", "--output", f"{tmp_path}/cmp.html",
                     timeout=120)
    assert compared.returncode == 0 and "| win_rate |" in compared.stdout and (tmp_path / "cmp.html").exists()


def test_s3_storage_run(tmp_path, s3_endpoint):
    endpoint, bucket = s3_endpoint
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint)
    root = f"s3://{bucket}/e2e"
    proc = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"run_dir: {root}/tiny" in proc.stdout
    cfg = load_config("configs/tiny.yaml", [f"storage.root={root}", f"storage.endpoint_url={endpoint}"])
    check_metrics(verify_run(cfg), cfg)

