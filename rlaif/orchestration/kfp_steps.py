"""The runtime side of the Kubeflow components (components/<stage>/component.py): what runs inside a component's
container. Each component's body calls `run_component`, which checks its upstream artifacts against storage and
launches the stage exactly as the local runner does; evaluate also publishes its metrics and report to the KFP UI.
No kfp import: the artifacts are duck-typed (`.path`, `.metadata`, `.log_metric`)."""
from __future__ import annotations

import json
import os

from rlaif.config.loading import refuse_repeated_keys
from rlaif.errors import Terminated, UserError
from rlaif.io import manifest, storage
from rlaif.orchestration.launch import launch, load_config_source, orchestrated_run_id, prepare
from rlaif.stages import common
from rlaif.stopping import stop_signals, stopped


def typed_overrides(policy_model: str = "", judge: str = "", ppo_lr: float = 0.0, kl_coef: float = -1.0,
                    iterations: int = 0, seed: int = -1) -> list[str]:
    """The pipeline's typed parameters (what runs are compared by in the KFP UI) as overrides. Left at their defaults
    they keep the config's: empty names, ppo_lr and iterations 0 or less, kl_coef and seed below 0 (0 is a value)."""
    chosen = {"policy.model": policy_model or None, "label.judge": judge or None,
              "ppo.lr": ppo_lr if ppo_lr > 0 else None, "ppo.kl_coef": kl_coef if kl_coef >= 0 else None,
              "ppo.iterations": iterations if iterations > 0 else None, "seed": seed if seed >= 0 else None}
    return [f"{key}={json.dumps(value)}" for key, value in chosen.items() if value is not None]


def run_component(name: str, config: str, overrides: list[str], run_id: str, storage_root: str,
                  default_run_id: str, upstream: dict, output, typed: dict, streaming: bool = False) -> dict:
    """_run_component, its failures reported as `rlaif launch` reports them (cli.report_failure: one `error:` line,
    exit code 2 for a user error), where KFP's executor printed a 30-line traceback for each; a SIGTERM that reaches
    the step's process stops it as it stops `rlaif launch` (rlaif.stopping), in exit code 143."""
    from rlaif.cli import report_failure

    try:
        with stop_signals():
            return _run_component(name, config, overrides, run_id, storage_root, default_run_id, upstream, output,
                                  typed, streaming)
    except (KeyboardInterrupt, Terminated) as stop:
        raise SystemExit(stopped(stop)) from None
    except Exception as exc:
        if (code := report_failure(exc)) is None:
            raise
        raise SystemExit(code) from None


def _run_component(name: str, config: str, overrides: list[str], run_id: str, storage_root: str,
                   default_run_id: str, upstream: dict, output, typed: dict, streaming: bool = False) -> dict:
    """The body of every KFP component: check that the upstream artifacts are the manifests in storage (a stale or
    foreign run directory is refused), launch the stage, and publish its manifest as this step's artifact. `typed`
    (the typed pipeline parameters) win over `overrides`. `streaming` (a pipeline compiled for label.streaming) turns
    the stage's streaming on: it then has no artifact of the upstream it streams, and checks that upstream's manifest
    itself when it commits."""
    from rlaif.models.loading import quiet_transformers

    quiet_transformers()
    # A retry of this step takes its lock back.
    os.environ.setdefault("RLAIF_LOCK_OWNER", f"kfp:{default_run_id}:{name}")
    refuse_repeated_keys(overrides)  # the user's own; the typed parameters after them win
    run_id = orchestrated_run_id(overrides, run_id, default_run_id)  # a run_id among them beats the KFP run's name
    overrides = [*overrides, *typed_overrides(**typed), *[f"{name}.streaming=true"] * streaming]
    cfg = load_config_source(config, overrides, run_id, storage_root)
    config_url = prepare(cfg, pipeline=True)
    for dep, artifact in upstream.items():
        if artifact is None:  # streamed: not committed when this step starts
            continue
        with open(artifact.path, encoding="utf-8") as f:
            passed = json.load(f)
        stored = manifest.require(common.stage_url(cfg, dep), dep)
        if passed["digest"] != stored["digest"]:
            raise UserError(f"upstream '{dep}' in storage ({stored['digest'][:12]}) is not the one this pipeline run "
                            f"produced ({passed['digest'][:12]}): another run wrote to run_id '{cfg.run_id}'")
    result = launch(cfg, name, config_url)
    with open(output.path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    output.metadata.update(url=common.stage_url(cfg, name), digest=result["digest"], run_id=cfg.run_id)
    return result


def publish_evaluation(result: dict, stage_url: str, metrics, report_html, report_md) -> None:
    """Evaluation in the KFP UI: scalar metrics, and the report as HTML and Markdown visualizations."""
    summary = result["summary"]
    for key in ("win_rate", "win_rate_length_controlled", "kl_to_reference", "reward_policy_mean",
                "reward_reference_mean", "n_prompts"):
        if summary[key] is not None:  # null: not a finite number (manifest.finite)
            metrics.log_metric(key, float(summary[key]))
    metrics.log_metric("win_rate_ci95_low", float(summary["win_rate_ci95"][0]))
    metrics.log_metric("win_rate_ci95_high", float(summary["win_rate_ci95"][1]))
    for judge, j in summary["judges"].items():
        if judge != "training":
            metrics.log_metric(f"win_rate_{judge}", float(j["win_rate"]))
    for artifact, name in ((report_html, "report.html"), (report_md, "report.md")):
        with open(artifact.path, "wb") as f:
            f.write(storage.read_bytes(storage.join(stage_url, name)))


def publish_model(result: dict, stage_url: str, subdir: str, model, metrics, keys: tuple[str, ...]) -> None:
    """A trained model in the KFP UI: a Model artifact (its model card and where the weights live; the weights stay
    in object storage, where the next stage reads them) with the key metrics as metadata, and a Metrics artifact."""
    summary = result["summary"]
    values = {key: float(summary[key]) for key in keys if isinstance(summary.get(key), (int, float))}
    for key, value in values.items():
        metrics.log_metric(key, value)
    weights_url = storage.join(stage_url, subdir)
    os.makedirs(model.path, exist_ok=True)
    with open(os.path.join(model.path, "README.md"), "w", encoding="utf-8") as f:
        f.write(storage.read_text(storage.join(weights_url, "README.md")))
    files = [f["path"] for f in result["files"] if f["path"].startswith(subdir + "/")]
    with open(os.path.join(model.path, "location.json"), "w", encoding="utf-8") as f:
        json.dump({"url": weights_url, "files": files, "manifest_digest": result["digest"]}, f, indent=2)
    model.metadata.update(storage_url=weights_url, framework="transformers", **values)
