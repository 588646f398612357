"""The trackers one call at a time: MLflow refused before training when misconfigured, TensorBoard flushed on its
interval, strict JSON metrics, W&B offline, a tracker failing mid-run. The whole pipeline against a live MLflow server
is tests/e2e/test_pipeline.py's S3 run."""
import json
import tempfile

import pytest


@pytest.fixture(autouse=True)
def stage_scratch(tmp_path, monkeypatch):
    """A tracker keeps its local files in the process temp directory, a stage's scratch (rlaif/scratch.py)."""
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))


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
