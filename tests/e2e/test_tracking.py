"""Tracking while a run is going: the tiny pipeline against a real MLflow server on loopback (SQLite backend). The
metrics of train_rm and ppo reach MLflow, and the TensorBoard logs reach storage, while those stages still run
(before their manifests exist); the params and the model card arrive as run params and artifacts."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("mlflow not found: pip install 'rlaif[mlflow]' (part of the dev extra)")
    port = free_port()
    proc = subprocess.Popen([exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--default-artifact-root", f"file://{root}/artifacts"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    deadline = time.time() + 120
    while True:
        try:
            client.search_experiments()
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("mlflow server did not start")
            time.sleep(0.5)
    yield uri, client
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def stage_run(client, stage: str):
    experiment = client.get_experiment_by_name("rlaif-e2e")
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`rlaif.stage` = '{stage}'")
    return runs[0] if runs else None


@pytest.mark.slow
def test_metrics_arrive_while_the_stages_run(tmp_path, mlflow_server):
    uri, client = mlflow_server
    root = tmp_path / "runs"
    argv = [sys.executable, "-m", "rlaif", "run", "--config", "configs/tiny.yaml", "--storage-root", f"file://{root}",
            "--set", "tracking.report_to=[tensorboard,mlflow]", "--set", f"tracking.mlflow_tracking_uri={uri}",
            "--set", "tracking.mlflow_experiment=rlaif-e2e", "--set", "tracking.flush_every_s=1",
            "--set", "ppo.iterations=12", "--set", "ppo.checkpoint_every=0"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The storage watcher polls on its own thread: the MLflow queries below take long enough on a loaded 2-core
    # machine to miss the interval between ppo's first flush and its manifest.
    ppo_dir = root / "tiny" / "ppo"
    tensorboard_seen = threading.Event()

    def watch_storage():
        while proc.poll() is None and not tensorboard_seen.is_set():
            if (ppo_dir / "tensorboard").is_dir() and not (ppo_dir / "manifest.json").exists():
                tensorboard_seen.set()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_storage, daemon=True)
    watcher.start()
    live = {"train_rm": False, "ppo": False}
    while proc.poll() is None:
        for stage in live:
            if not live[stage] and not (root / "tiny" / stage / "manifest.json").exists():
                run = stage_run(client, stage)
                live[stage] = bool(run and run.data.metrics)
        time.sleep(0.2)
    watcher.join()
    tensorboard_live = tensorboard_seen.is_set()
    output = proc.stdout.read()
    assert proc.returncode == 0, output[-3000:]
    assert live == {"train_rm": True, "ppo": True}, "metrics reached MLflow only after the stage ended"
    assert tensorboard_live, "the TensorBoard logs reached storage only after ppo ended"

    ppo = stage_run(client, "ppo")
    assert ppo.info.run_name == "tiny/ppo" and ppo.info.status == "FINISHED"
    assert ppo.data.params["ppo.iterations"] == "12" and ppo.data.params["policy.model"] == "builtin:tiny-llama"
    history = client.get_metric_history(ppo.info.run_id, "reward_raw")
    assert [m.step for m in history] == list(range(1, 13))
    assert [a.path for a in client.list_artifacts(ppo.info.run_id)] == ["README.md"]
    card = Path(client.download_artifacts(ppo.info.run_id, "README.md", str(tmp_path)))
    assert "base_model: builtin:tiny-llama" in card.read_text()
    rm = stage_run(client, "train_rm")
    assert "loss" in rm.data.metrics and rm.data.params["train_rm.batch_size"] == "8"

    # A re-run with a changed tracking setting is a cache hit: tracking is not part of any cache key.
    changed = [item.replace("tracking.flush_every_s=1", "tracking.flush_every_s=5") for item in argv]
    again = subprocess.run(changed, cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and again.stdout.count("cache hit") == 5, again.stdout[-2000:]


def tracker_context(tmp_path, overrides: list[str]):
    from types import SimpleNamespace

    from rlaif.config import load_config
    from rlaif.graph import STAGE_BY_NAME

    cfg = load_config("configs/tiny.yaml", overrides)
    return SimpleNamespace(cfg=cfg, stage=STAGE_BY_NAME["ppo"], url=f"file://{tmp_path}/ppo", config_hash="0" * 64)


@pytest.mark.parametrize("overrides, message", [
    (["tracking.report_to=[mlflow]"], "no server: set tracking.mlflow_tracking_uri or $MLFLOW_TRACKING_URI"),
    (["tracking.report_to=[mlflow]", "tracking.mlflow_tracking_uri=http://127.0.0.1:9"], "did not answer"),
])
def test_mlflow_misconfigured_is_a_one_line_error_before_training(tmp_path, monkeypatch, overrides, message):
    from rlaif.errors import UserError
    from rlaif.tracking import Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(UserError) as err:
        Tracker(tracker_context(tmp_path, overrides), enabled=True)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_tensorboard_flushes_to_storage_on_the_interval(tmp_path, monkeypatch):
    from rlaif.tracking import Tracker

    tracker = Tracker(tracker_context(tmp_path, ["tracking.flush_every_s=1"]), enabled=True)
    tracker.log(1, {"loss": 1.0})
    assert not (tmp_path / "ppo" / "metrics.jsonl").exists()  # not yet: the interval has not passed
    tracker.last_flush -= 2
    tracker.log(2, {"loss": 0.5})
    assert (tmp_path / "ppo" / "metrics.jsonl").read_text().count("loss") == 2
    assert any((tmp_path / "ppo" / "tensorboard").iterdir())
    files = tracker.publish()
    assert {f["path"] for f in files} >= {"metrics.jsonl"}


def test_metrics_jsonl_is_strict_json_when_a_metric_is_not_finite(tmp_path):
    """A NaN loss (one sample's std, a diverged step) is written as null: strict parsers refuse a bare NaN."""
    from rlaif.tracking import Tracker

    tracker = Tracker(tracker_context(tmp_path, ["tracking.report_to=[]"]), enabled=True)
    tracker.log(1, {"loss": float("nan"), "kl": float("inf"), "reward": 0.5})
    tracker.publish()
    line = (tmp_path / "ppo" / "metrics.jsonl").read_text().strip()
    strict = json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl"))
    assert strict == {"step": 1, "loss": None, "kl": None, "reward": 0.5}


def test_wandb_offline_run_records_metrics_params_and_card(tmp_path, monkeypatch):
    """W&B in offline mode (no account, no network): the run directory holds the params, the metrics and the model
    card that a `wandb sync` would upload."""
    pytest.importorskip("wandb", reason="wandb is an optional tracker (pip install wandb)")
    from rlaif.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(tracker_context(tmp_path, ["tracking.report_to=[wandb]"]), enabled=True)
    for step in (1, 2, 3):
        tracker.log(step, {"reward_raw": step / 10, "kl": 0.01 * step})
    card = tmp_path / "README.md"
    card.write_text("---\nbase_model: builtin:tiny-llama\n---\n")
    tracker.publish((card,))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # A fresh attempt gets a fresh W&B run id, recorded beside the metrics so a resumed attempt continues it.
    assert run_dir.name.endswith(json.loads((tmp_path / "ppo" / "tracking.json").read_text())["wandb"])
    # The offline log is W&B's binary record stream (what `wandb sync` uploads): the metrics and params are in it.
    (log,) = run_dir.glob("run-*.wandb")
    records = log.read_bytes()
    for text in (b"reward_raw", b"0.3", b"kl", b"ppo.iterations", b"builtin:tiny-llama"):
        assert text in records, text
    assert (run_dir / "files" / "README.md").read_text().startswith("---\nbase_model")


def test_a_tracker_that_fails_mid_run_is_switched_off_not_fatal(tmp_path, capsys):
    from rlaif.tracking import Tracker

    class Flaky:
        name, run_id, calls = "mlflow", "r1", 0

        def log(self, step, row):
            Flaky.calls += 1
            raise ConnectionError("server went away")

    tracker = Tracker(tracker_context(tmp_path, ["tracking.report_to=[]"]), enabled=True)
    tracker.remote.append(Flaky())
    tracker.log(1, {"loss": 1.0})
    tracker.log(2, {"loss": 0.5})
    assert Flaky.calls == 1 and tracker.remote == []
    assert capsys.readouterr().err.count("tracker mlflow failed (ConnectionError: server went away)") == 1
    tracker.publish()
    assert (tmp_path / "ppo" / "metrics.jsonl").read_text().count("loss") == 2


def test_a_resumed_attempt_keeps_the_metrics_up_to_its_checkpoint_and_its_tracker_runs(tmp_path):
    from rlaif.tracking import Tracker

    ctx = tracker_context(tmp_path, ["tracking.report_to=[]"])
    first = Tracker(ctx, enabled=True)
    for step in (1, 2, 3):
        first.log(step, {"loss": 1.0 / step})
    first.flush()  # then the attempt dies after step 3; its checkpoint is at step 2
    (tmp_path / "ppo" / "tracking.json").write_text(json.dumps({"mlflow": "run-of-attempt-1"}))
    resumed = Tracker(ctx, enabled=True, resume_step=2)
    assert [json.loads(line)["step"] for line in (resumed.dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert resumed._restore(2, [(1, {"loss": 1.0}), (2, {"loss": 0.5})]) == {"mlflow": "run-of-attempt-1"}
