"""Training metrics where teams look while a run is going: metrics.jsonl and TensorBoard logs in the stage's directory
(copied to storage every `tracking.flush_every_s`, not only at the end), and optionally MLflow and W&B. Rank 0 only.

A tracker that cannot start is a one-line error before any training; one that fails in the middle of a run (a server
outage) warns once and is switched off: a tracker never ends a multi-hour stage. Each attempt of a stage opens a new
tracker run, except an attempt resumed from a checkpoint, which continues the run its `tracking.json` names."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rlaif.errors import UserError, one_line, redact
from rlaif.io import storage, user_files
from rlaif.io.manifest import json_line

IDENTITY = "tracking.json"  # the tracker run ids of the stage's current attempt, beside its metrics


def _flat(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat(f"{prefix}.{key}" if prefix else key, item, out)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    return out


def _numbers(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MLflowRun:
    """One MLflow run per attempt of a stage, named `<run_id>/<stage>`, tagged with the stage's storage URL."""

    name = "mlflow"

    def __init__(self, ctx, params: dict, run_id: str | None):
        try:
            import mlflow
        except ImportError:
            raise UserError('tracking.report_to has mlflow but the client is missing: pip install "rlaif[tracking]"') \
                from None
        settings = ctx.cfg.tracking
        uri = mlflow_uri(settings)
        for name, value in MLFLOW_BOUNDS.items():
            os.environ.setdefault(name, value)
        try:
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            self.run_id = run_id or self._create(ctx, settings.mlflow_experiment, params)
        except Exception as exc:  # MlflowException or requests' errors, for one cause: the server
            raise UserError(f"MLflow server {redact(uri)} did not answer ({type(exc).__name__}): check "
                            "tracking.mlflow_tracking_uri and the server") from None

    def _create(self, ctx, experiment_name: str, params: dict) -> str:
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        tags = {"rlaif.run_id": ctx.cfg.run_id, "rlaif.stage": ctx.stage.name, "rlaif.stage_url": ctx.url,
                "rlaif.cache_key": ctx.config_hash}
        run = self.client.create_run(experiment_id, run_name=f"{ctx.cfg.run_id}/{ctx.stage.name}", tags=tags)
        for key, value in params.items():
            self.client.log_param(run.info.run_id, key, str(value)[:6000])
        return run.info.run_id

    def log(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in _numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id)


def mlflow_uri(settings) -> str:
    uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("tracking.report_to has mlflow but no server: set tracking.mlflow_tracking_uri or "
                        "$MLFLOW_TRACKING_URI")
    if HOST_PORT.fullmatch(uri.strip()):  # MLflow would read `localhost` as a URI scheme, deep in the stage
        raise UserError(f"MLflow tracking URI {uri!r} has no scheme: write http://{uri.strip()}")
    return uri


HOST_PORT = re.compile(r"[A-Za-z0-9.-]+:\d+(/.*)?")
# MLflow retries a request 7 times with doubling waits (about 4 minutes) before it says a server is gone, which a
# stage spends blocked; these bound it unless the environment sets them.
MLFLOW_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def check_settings(settings) -> None:
    """What can be known about the trackers before any work (the training stages open them only after generate and
    label have run): an MLflow server named (W&B's key: check_wandb_credentials, where the stages run)."""
    if "mlflow" in settings.report_to:
        check_mlflow_answers(mlflow_uri(settings))


WANDB_OFFLINE_MODES = ("offline", "disabled", "dryrun")
WANDB_MISSING = 'tracking.report_to has wandb but it is missing: pip install "rlaif[tracking]"'


def check_wandb_credentials(settings) -> None:
    """W&B (in tracking.report_to) finds a key here, or runs offline, as its own start in train_rm and ppo will see
    it: without one they would fail after generate and label have run. Read with wandb's own settings (environment,
    settings files, its default host) and netrc lookup; where this wandb keeps them elsewhere (another version), its
    start in the stage decides."""
    if "wandb" not in settings.report_to:
        return
    if (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
            or os.environ.get("WANDB_MODE", "").strip().lower() in WANDB_OFFLINE_MODES):
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError(WANDB_MISSING) from None
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import read_netrc_auth

        resolved = wandb_setup.singleton().settings
        if str(resolved.mode) in WANDB_OFFLINE_MODES or resolved.api_key or read_netrc_auth(host=resolved.base_url):
            return
        host = resolved.base_url
    except Exception:  # noqa: BLE001 - another wandb lays its settings out otherwise: its own start decides
        return
    raise UserError(f"tracking.report_to has wandb, and W&B finds no API key here for {host} (WANDB_API_KEY, or "
                    "`wandb login`): set one, or WANDB_MODE=offline")


def check_mlflow_answers(uri: str, timeout_s: float = 10.0) -> None:
    """An MLflow server (http or https URI) answers its health check: a server that is down or never answers is a
    one-line error now, not after generate and label have run. Any HTTP answer counts (an older server without
    /health, a proxy asking for credentials): the stage's client checks the rest."""
    if not uri.startswith(("http://", "https://")):
        return  # databricks, file stores: the client's own start in the stage is the check
    from rlaif.io import endpoint as http

    try:
        http.get(http.without_credentials(uri).rstrip("/") + "/health", timeout_s)
    except http.NoAnswer as why:
        raise UserError(f"MLflow server {redact(uri)} {why}: start it, or fix "
                        "tracking.mlflow_tracking_uri / $MLFLOW_TRACKING_URI") from None


class WandbRun:
    name = "wandb"

    def __init__(self, ctx, params: dict, run_id: str | None):
        try:
            import wandb
        except ImportError:
            raise UserError(WANDB_MISSING) from None
        settings = ctx.cfg.tracking
        try:
            self.run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity, config=params,
                                  name=f"{ctx.cfg.run_id}/{ctx.stage.name}", id=run_id or uuid.uuid4().hex[:16],
                                  resume="allow" if run_id else None, tags=["rlaif", ctx.stage.name])
        except Exception as exc:  # wandb's UsageError (no API key), CommError (no server), ...
            reason = one_line(exc, 200)
            raise UserError(f"W&B did not start ({type(exc).__name__}: {reason}): set WANDB_API_KEY, or "
                            "WANDB_MODE=offline") from None
        self.run_id = self.run.id

    def log(self, step: int, row: dict) -> None:
        self.run.log(_numbers(row), step=step)

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.finish()


class Tracker:
    """Per-step metrics to metrics.jsonl, TensorBoard, MLflow and W&B as `tracking` asks; rank 0 only. `resume_step`:
    the step a checkpoint restored (0: a fresh start); the metrics up to it are kept (`restored_rows`, (step, row)
    pairs, when the checkpoint carries them, else the stored metrics.jsonl), and the interrupted attempt's tracker
    runs go on."""

    def __init__(self, ctx, enabled: bool, resume_step: int = 0, restored_rows: list[tuple[int, dict]] | None = None):
        self.enabled, self.url, self.settings = enabled, ctx.url, ctx.cfg.tracking
        self.writer, self.remote = None, []
        if not enabled:
            return
        self.dir = Path(tempfile.mkdtemp(prefix="rlaif-metrics-"))
        previous = self._restore(resume_step, restored_rows) if resume_step else {}
        params = _flat("", {"seed": ctx.cfg.seed, "policy.model": ctx.cfg.policy.model,
                            "label.judge": ctx.cfg.label.judge,
                            ctx.stage.name: getattr(ctx.cfg, ctx.stage.name).model_dump()}, {})
        if "tensorboard" in self.settings.report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        for kind, tracker in (("mlflow", MLflowRun), ("wandb", WandbRun)):
            if kind in self.settings.report_to:
                self.remote.append(tracker(ctx, params, previous.get(kind)))
        (self.dir / IDENTITY).write_text(json.dumps({run.name: run.run_id for run in self.remote}))
        self.last_flush = time.monotonic()  # the interval starts when training can start

    def _restore(self, resume_step: int, rows: list[tuple[int, dict]] | None) -> dict:
        """The interrupted attempt's metrics up to the checkpoint (later ones will be logged again) and tracker ids."""
        stored = storage.join(self.url, "metrics.jsonl")
        if rows is not None:
            kept = [json_line({"step": step, **row}) for step, row in rows]
        elif storage.exists(stored):
            kept = [line for line in user_files.text_lines(storage.read_text(stored))
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        else:
            kept = []
        (self.dir / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
        identity = storage.join(self.url, IDENTITY)
        return json.loads(storage.read_text(identity)) if storage.exists(identity) else {}

    def log(self, step: int, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json_line({"step": step, **row}) + "\n")
        if self.writer:
            for key, value in _numbers(row).items():
                self.writer.add_scalar(key, value, step)
        self._each_remote(lambda run: run.log(step, row))
        if time.monotonic() - self.last_flush >= self.settings.flush_every_s:
            self.flush()

    def _each_remote(self, action) -> None:
        """A tracker that fails mid-run (its server went away) warns once and is switched off; training goes on."""
        for run in list(self.remote):
            try:
                action(run)
            except Exception as exc:
                reason = one_line(exc, 160)
                print(f"warning: tracker {run.name} failed ({type(exc).__name__}: {reason}); it is off for the rest "
                      "of this stage (metrics.jsonl and TensorBoard go on)", file=sys.stderr, flush=True)
                self.remote.remove(run)

    def flush(self) -> list[dict]:
        """Copy metrics.jsonl and the TensorBoard logs to the stage's directory in storage now."""
        if self.writer:
            self.writer.flush()
        self.last_flush = time.monotonic()
        return storage.upload_dir(self.dir, self.url)

    def publish(self, artifacts: tuple[Path, ...] = ()) -> list[dict]:
        """The final upload (manifest file entries); the trackers' runs end with `artifacts` (e.g. the model card)."""
        if not self.enabled:
            return []
        if self.writer:
            self.writer.close()
        try:
            files = self.flush()
            self._each_remote(lambda run: run.finish(list(artifacts)))
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return files
