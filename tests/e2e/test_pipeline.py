"""The whole pipeline on the tiny config, as real processes (torchrun for the training stages)."""
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from process_output import failure

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


def front_matter(card: Path) -> dict:
    import yaml

    text = card.read_text()
    assert text.startswith("---\n"), f"{card} has no Hugging Face front matter"
    return yaml.safe_load(text.split("---\n")[1])


def check_model_cards(run_dir: Path, cfg):
    """Every exported model carries a Hugging Face model card naming its base model as the user did, its run and
    config digest, and its metrics; the adapter points at the base model by that name, not a cache path."""
    ppo = manifest.require(storage.join(run_url(cfg), "ppo"), "ppo")
    rm = manifest.require(storage.join(run_url(cfg), "train_rm"), "train_rm")
    for path, base, library, stage in (("ppo/policy", cfg.policy.model, "transformers", ppo),
                                       ("ppo/adapter", cfg.policy.model, "peft", ppo),
                                       ("train_rm/model", cfg.train_rm.backbone, "transformers", rm)):
        card = run_dir / path / "README.md"
        meta = front_matter(card)
        assert meta["base_model"] == base and meta["library_name"] == library and "rlaif" in meta["tags"], path
        text = card.read_text()
        assert f"| run id | {cfg.run_id} |" in text and f"| cache key | {stage['config_hash'][:16]} |" in text
        assert any(f["path"] == path.split("/", 1)[1] + "/README.md" for f in stage["files"]), path
    held_out = rm["summary"]["held_out_accuracy"]
    assert f"| held_out_accuracy | {held_out:.4g} |" in (run_dir / "train_rm/model/README.md").read_text()
    adapter = json.loads((run_dir / "ppo/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == cfg.policy.model


def test_file_storage_run_then_cache_hits(tmp_path):
    root = f"file://{tmp_path}/runs"
    first = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"run_dir: {root}/tiny" in first.stdout and "report: " in first.stdout
    for stage in STAGES:
        assert f"[{stage.name}] running" in first.stdout
    # a run that goes well prints no library warnings (DeepSpeed's accelerator probe, peft's adapter save)
    assert not re.search(r"\[WARNING\]|\w+Warning:", first.stdout + first.stderr), first.stdout + first.stderr
    cfg = load_config("configs/tiny.yaml", [f"storage.root={root}"])
    check_metrics(verify_run(cfg), cfg)
    assert (tmp_path / "runs/tiny/evaluate/report.html").read_text().startswith("<!doctype html>")
    assert (tmp_path / "runs/tiny/ppo/reward_kl.png").stat().st_size > 1000
    assert (tmp_path / "runs/tiny/ppo/policy/model.safetensors").exists()
    check_model_cards(tmp_path / "runs/tiny", cfg)

    report = tmp_path / "runs/tiny/evaluate/report.html"
    report.unlink()  # a view of evaluate's files, not in its manifest: a cache hit printed a path to nothing
    second = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, timeout=300)
    assert second.returncode == 0, failure(second)
    assert "running" not in second.stdout
    assert second.stdout.count("cache hit") == len(STAGES)
    assert f"report: {report.as_uri()}" in second.stdout and report.read_text().startswith("<!doctype html>")
    empty = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--run-id", "", timeout=60)
    assert empty.returncode == 2 and "error: --run-id is empty" in empty.stderr  # it ran the config's run id

    # A damaged output is made again, not a cache hit; --rerun runs a stage past its cache.
    shard = sorted((tmp_path / "runs/tiny/generate").glob("shard-*.tar"))[0]
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    healed = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, timeout=600)
    assert healed.returncode == 0, failure(healed)
    assert (f"[generate] its output for this config is damaged ({shard.name} has {size // 2} bytes where its "
            f"manifest says {size}): running it again") in healed.stdout and "[generate] running" in healed.stdout
    listed = json.loads((tmp_path / "runs/tiny/generate/manifest.json").read_text())["shards"]
    assert shard.stat().st_size == next(s["bytes"] for s in listed if s["url"] == shard.name)
    forced = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--rerun", "label", timeout=600)
    assert forced.returncode == 0 and "[label] running" in forced.stdout, failure(forced)
    assert "[generate] cache hit" in forced.stdout

    # A changed PPO setting re-runs ppo and evaluate only.
    # (checkpoint_every is not part of the key: a checkpoint per iteration, for the --rerun below)
    third = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.lr=2e-3",
                  "--set", "ppo.checkpoint_every=1", timeout=600)
    assert third.returncode == 0, failure(third)
    assert [s.name for s in STAGES if f"[{s.name}] running" in third.stdout] == ["ppo", "evaluate"]
    # --rerun runs the stage again from its start, not from its last checkpoint; the same output leaves evaluate cached
    again = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.lr=2e-3",
                  "--rerun", "ppo", timeout=600)
    assert again.returncode == 0, failure(again)
    assert "[ppo] starting afresh: removing the previous output (" in again.stdout
    assert "resumed from checkpoint" not in again.stdout and "[evaluate] cache hit" in again.stdout
    # The rebuilt report of a run made this way has no notes: the report's recomputed cache keys are the stages' own
    current = rlaif("report", f"{tmp_path}/runs/tiny", timeout=120)
    md = (tmp_path / "runs/tiny/evaluate/report.md").read_text()
    assert current.returncode == 0 and "compared with each evaluated stage's cache key" in md, md
    assert "These results" not in md and "config.yaml no longer" not in md, md
    assert "⚠ config.yaml now" not in md and "⚠ may not be the evaluated" not in md, md  # no provenance row marked

    # A quality gate that fails: exit 2 with the reason, the report shows it, and no evaluate manifest is written.
    gated = rlaif("run", "--config", "configs/tiny.yaml", "--storage-root", root, "--set", "ppo.lr=2e-3",
                  "--set", "evaluate.min_win_rate=1", timeout=600)
    assert gated.returncode == 2 and "quality gate failed: win rate" in gated.stderr
    assert not (tmp_path / "runs/tiny/evaluate/manifest.json").exists()
    assert 'class="fail"' in (tmp_path / "runs/tiny/evaluate/report.html").read_text()

    rebuilt = rlaif("report", f"{tmp_path}/runs/tiny", timeout=120)
    assert rebuilt.returncode == 0 and "report: " in rebuilt.stdout
    shutil.copytree(tmp_path / "runs/tiny", tmp_path / "runs/copy")  # a run given twice is refused
    compared = rlaif("report", f"{tmp_path}/runs/tiny", f"{tmp_path}/runs/copy", "--output", f"{tmp_path}/cmp.html",
                     timeout=120)
    assert compared.returncode == 0 and "| win_rate |" in compared.stdout and (tmp_path / "cmp.html").exists()

    # A stage launched on a damaged upstream is refused before it removes its own old output.
    (tmp_path / "runs/copy/train_rm/model/model.safetensors").unlink()
    kept = sorted(p.name for p in (tmp_path / "runs/copy/ppo").iterdir())
    refused = rlaif("launch", "ppo", "--config", "configs/tiny.yaml", "--storage-root", root, "--run-id", "copy",
                    "--set", "ppo.lr=2e-3", "--rerun", timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: stage 'ppo' reads 'train_rm', whose output in run 'copy' is damaged (model/model.safetensors "
        "is missing): run it again (`rlaif run --rerun train_rm`, or `rlaif launch train_rm --rerun`)"), refused.stderr
    assert sorted(p.name for p in (tmp_path / "runs/copy/ppo").iterdir()) == kept


def mlflow_stage_run(client, stage: str):
    experiment = client.get_experiment_by_name("rlaif-e2e")
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlaif.stage` = '{stage}'")
    return runs[0] if runs else None


def answered(query) -> bool:
    """A storage or MLflow query that fails while the run goes (a busy 2-core machine) counts as not yet."""
    try:
        return bool(query())
    except Exception:
        return False


def watch_tracking(proc, client, on_s3, deadline: float) -> tuple[dict, bool]:
    """While the run goes: which of train_rm and ppo had metrics in MLflow before their manifests, and whether ppo's
    TensorBoard files reached storage before its manifest (each seen first, then the manifest seen absent)."""
    tensorboard_seen = threading.Event()

    def metrics_before_manifest(stage: str) -> bool:
        run = mlflow_stage_run(client, stage)
        return bool(run and run.data.metrics) and not on_s3(f"{stage}/manifest.json")

    # The storage watcher polls on its own thread: the MLflow queries below take long enough on a loaded 2-core
    # machine to miss the interval between ppo's first flush and its manifest.
    def watch_storage():
        while proc.poll() is None and not tensorboard_seen.is_set():
            if answered(lambda: on_s3("ppo/tensorboard/") and not on_s3("ppo/manifest.json")):
                tensorboard_seen.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_storage, daemon=True)
    watcher.start()
    live = {"train_rm": False, "ppo": False}
    while proc.poll() is None and time.time() < deadline:
        for stage in live:
            live[stage] = live[stage] or answered(functools.partial(metrics_before_manifest, stage))
        time.sleep(0.2)
    watcher.join(timeout=10)
    return live, tensorboard_seen.is_set()


def test_s3_storage_run_tracked_live_in_mlflow(tmp_path, s3_endpoint, mlflow_server):
    """A cluster deployment's run: S3 storage, MLflow and TensorBoard tracking. Every output on S3 checks out; the
    metrics of train_rm and ppo reach MLflow, and ppo's TensorBoard logs reach S3, while those stages still run
    (before their manifests exist); params and the model card arrive as MLflow run params and artifacts."""
    import boto3

    endpoint, bucket = s3_endpoint
    uri, client = mlflow_server
    root = f"s3://{bucket}/e2e"
    argv = [sys.executable, "-m", "rlaif", "run", "--config", "configs/tiny.yaml", "--storage-root", root,
            "--set", "tracking.report_to=[tensorboard,mlflow]", "--set", f"tracking.mlflow_tracking_uri={uri}",
            "--set", "tracking.mlflow_experiment=rlaif-e2e", "--set", "tracking.flush_every_s=1",
            "--set", "ppo.iterations=12", "--set", "ppo.checkpoint_every=0"]
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint)
    s3 = boto3.client("s3", endpoint_url=endpoint)

    def on_s3(prefix: str) -> bool:
        return s3.list_objects_v2(Bucket=bucket, Prefix=f"e2e/tiny/{prefix}", MaxKeys=1).get("KeyCount", 0) > 0

    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        live, tensorboard_live = watch_tracking(proc, client, on_s3, deadline=time.time() + 900)
    finally:
        if proc.poll() is None:  # past the deadline, or the watch failed: the run and its stages stop
            proc.terminate()
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert f"run_dir: {root}/tiny" in output
    cfg = load_config("configs/tiny.yaml", [f"storage.root={root}", f"storage.endpoint_url={endpoint}"])
    check_metrics(verify_run(cfg), cfg)
    assert live == {"train_rm": True, "ppo": True}, "metrics reached MLflow only after the stage ended"
    assert tensorboard_live, "the TensorBoard logs reached storage only after ppo ended"

    ppo = mlflow_stage_run(client, "ppo")
    assert ppo.info.run_name == "tiny/ppo" and ppo.info.status == "FINISHED"
    assert ppo.data.params["ppo.iterations"] == "12" and ppo.data.params["policy.model"] == "builtin:tiny-llama"
    history = client.get_metric_history(ppo.info.run_id, "reward_raw")
    assert [m.step for m in history] == list(range(1, 13))
    assert [a.path for a in client.list_artifacts(ppo.info.run_id)] == ["README.md"]
    card = Path(client.download_artifacts(ppo.info.run_id, "README.md", str(tmp_path)))
    assert "base_model: builtin:tiny-llama" in card.read_text()
    rm = mlflow_stage_run(client, "train_rm")
    assert "loss" in rm.data.metrics and rm.data.params["train_rm.batch_size"] == "8"

    # A re-run with a changed tracking setting is a cache hit: tracking is not part of any cache key.
    changed = [item.replace("tracking.flush_every_s=1", "tracking.flush_every_s=5") for item in argv]
    again = subprocess.run(changed, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("cache hit") == len(STAGES), again.stdout[-2000:]
