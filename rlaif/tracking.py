"""Training metrics where teams look while a run is going: metrics.jsonl and TensorBoard logs in the stage's directory
(copied to storage every `tracking.flush_every_s`, not only at the end), and optionally MLflow and W&B. Rank 0 only.

Each tracker is optional and fails loudly at the start (a missing package or server is a one-line error before any
training), never in the middle of a run."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from rlaif.errors import UserError
from rlaif.io import storage


def _flat(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat(f"{prefix}.{key}" if prefix else key, item, out)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    return out


class MLflowRun:
    """One MLflow run per stage of a pipeline run (`<run_id>/<stage>`); a resumed stage continues its run."""

    def __init__(self, ctx, params: dict):
        try:
            import mlflow
        except ImportError:
            raise UserError('tracking.report_to has mlflow but the package is missing: pip install "rlaif[mlflow]"') \
                from None
        settings = ctx.cfg.tracking
        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise UserError("tracking.report_to has mlflow but no server: set tracking.mlflow_tracking_uri or "
                            "$MLFLOW_TRACKING_URI")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        try:
            experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(settings.mlflow_experiment))
        except Exception as exc:  # the client raises MlflowException or requests' errors for one cause
            raise UserError(f"MLflow server {uri} did not answer ({type(exc).__name__}): check "
                            "tracking.mlflow_tracking_uri") from None
        tags = {"rlaif.run_id": ctx.cfg.run_id, "rlaif.stage": ctx.stage.name, "rlaif.config_hash": ctx.config_hash}
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        found = self.client.search_runs([experiment_id], filter_string=query, max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(experiment_id, run_name=f"{ctx.cfg.run_id}/{ctx.stage.name}", tags=tags)
            self.run_id = run.info.run_id
            for key, value in params.items():
                self.client.log_param(self.run_id, key, str(value)[:6000])

    def log(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in row.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id)


class WandbRun:
    def __init__(self, ctx, params: dict):
        try:
            import wandb
        except ImportError:
            raise UserError('tracking.report_to has wandb but the package is missing: pip install wandb') from None
        settings = ctx.cfg.tracking
        self.wandb = wandb
        self.run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity, config=params,
                              name=f"{ctx.cfg.run_id}/{ctx.stage.name}", id=f"{ctx.config_hash[:24]}-{ctx.stage.name}",
                              resume="allow", tags=["rlaif", ctx.stage.name])

    def log(self, step: int, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.finish()


class Tracker:
    """Per-step metrics to metrics.jsonl, TensorBoard, MLflow and W&B as `tracking` asks; rank 0 only."""

    def __init__(self, ctx, enabled: bool):
        self.enabled, self.url, self.settings = enabled, ctx.url, ctx.cfg.tracking
        self.writer, self.remote, self.last_flush = None, [], time.monotonic()
        if not enabled:
            return
        self.dir = Path(tempfile.mkdtemp(prefix="rlaif-metrics-"))
        params = _flat("", {"seed": ctx.cfg.seed, "policy.model": ctx.cfg.policy.model,
                            "label.judge": ctx.cfg.label.judge,
                            ctx.stage.name: getattr(ctx.cfg, ctx.stage.name).model_dump()}, {})
        if "tensorboard" in self.settings.report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        if "mlflow" in self.settings.report_to:
            self.remote.append(MLflowRun(ctx, params))
        if "wandb" in self.settings.report_to:
            self.remote.append(WandbRun(ctx, params))
        self.last_flush = time.monotonic()  # the interval starts when training can start

    def log(self, step: int, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        for key, value in row.items():
            if self.writer and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        for run in self.remote:
            run.log(step, row)
        if time.monotonic() - self.last_flush >= self.settings.flush_every_s:
            self.flush()

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
        files = self.flush()
        for run in self.remote:
            run.finish(list(artifacts))
        shutil.rmtree(self.dir, ignore_errors=True)
        return files
