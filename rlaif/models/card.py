"""Model cards in the Hugging Face format (README.md: YAML front matter, then Markdown) for every model the pipeline
exports: what the model is, what it started from (as the user named it), how it was trained and on what, how it
scored, and which run made it (run id, stage cache key, code version)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlaif import __version__
from rlaif.io import hub
from rlaif.io.digest import code_digest

LOAD = "Load with `transformers.{auto}.from_pretrained(this_directory, use_safetensors=True)`."


def base_model_id(spec: str) -> tuple[str, str | None]:
    """(name, revision) of a base model as the card and an adapter record it: a hub model by its repo id (the form
    the Hub and peft resolve), anything else (a local or s3:// directory, a builtin) exactly as the config names it."""
    parsed = hub.parse(spec)
    return parsed if parsed else (spec, None)


def _front_matter(base_model: str, library: str, tags: list[str], pipeline_tag: str | None) -> str:
    meta = {"base_model": base_model_id(base_model)[0], "library_name": library, "tags": ["rlaif", *tags]}
    if pipeline_tag:
        meta["pipeline_tag"] = pipeline_tag
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _table(rows: dict) -> str:
    lines = ["| | |", "|---|---|"]
    for key, value in rows.items():
        shown = f"{value:.4g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, (list, dict)) \
            else str(value)
        lines.append(f"| {key} | {shown} |")
    return "\n".join(lines)


def render(*, title: str, summary: str, base_model: str, library: str, tags: list[str], training: dict,
           data: dict, metrics: dict, run: dict, pipeline_tag: str | None = None, usage: str = "") -> str:
    """The card's text. `training`, `data`, `metrics` and `run` are flat {label: value} tables."""
    run = {**run, "rlaif version": __version__, "code digest": code_digest()[:16]}
    parts = [_front_matter(base_model, library, tags, pipeline_tag), f"# {title}", "", summary, "",
             f"Base model: `{base_model}`.", "", "## Training", "", _table(training), "", "## Data", "",
             _table(data), "", "## Evaluation", "", _table(metrics) if metrics else "Not evaluated by this stage.",
             "", "## Provenance", "", _table(run), ""]
    if usage:
        parts += ["## Usage", "", usage, ""]
    return "\n".join(parts)


def write(directory: Path, text: str) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(text, encoding="utf-8")
    return path


def run_facts(ctx) -> dict:
    """The provenance rows every card carries: the pipeline run and the digest of the config it ran with."""
    return {"run id": ctx.cfg.run_id, "stage": ctx.stage.name, "cache key": ctx.config_hash[:16],
            "prompts": ctx.cfg.data.prompts, "seed": ctx.cfg.seed}


def policy_card(ctx, rows: list[dict], adapter: bool) -> str:
    """The tuned policy's card (merged weights, or the LoRA adapter on the base model)."""
    cfg, settings = ctx.cfg, ctx.cfg.ppo
    reward = ("the reward model of this run's train_rm stage" if settings.reward == "reward_model"
              else f"the `{cfg.label.judge}` judge scoring each response (d-RLAIF)")
    first, last = rows[0], rows[-1]
    what = "A LoRA adapter" if adapter else "A causal language model"
    return render(
        title=f"RLAIF-tuned policy ({'LoRA adapter' if adapter else 'merged weights'})",
        summary=f"{what} fine-tuned with {settings.algorithm.upper()} from AI feedback by the rlaif pipeline: "
                f"the reward is {reward}, "
                + ("with a KL penalty to the starting policy." if "kl" in last else "without a KL penalty."),
        base_model=cfg.policy.model, library="peft" if adapter else "transformers",
        tags=[settings.algorithm, "lora" if adapter else "merged"], pipeline_tag=None if adapter else "text-generation",
        training={"algorithm": settings.algorithm, "iterations": settings.iterations, "learning rate": settings.lr,
                  "KL coefficient": settings.kl_coef, "rollout batch": settings.rollout_batch_size,
                  "LoRA rank": settings.lora_rank, "max new tokens": settings.max_new_tokens,
                  "strategy": settings.strategy},
        data={"prompts": cfg.data.prompts, "held-out fraction": cfg.data.eval_fraction,
              "label judge": cfg.label.judge, "constitution": cfg.label.constitution},
        metrics={"reward (first iteration)": first["reward_raw"], "reward (last iteration)": last["reward_raw"],
                 **({"KL to start (last iteration)": last["kl"]} if "kl" in last else {})},
        run=run_facts(ctx),
        usage=("Load with `peft.PeftModel.from_pretrained(base, this_directory)`." if adapter
               else LOAD.format(auto="AutoModelForCausalLM")),
    )


def reward_model_card(ctx, summary: dict) -> str:
    """The reward (preference) model's card."""
    cfg, settings = ctx.cfg, ctx.cfg.train_rm
    return render(
        title="RLAIF reward model",
        summary="A sequence-classification model scoring how well a response follows the constitution, trained with a "
                "Bradley-Terry loss on soft AI preference labels by the rlaif pipeline. reward_stats.json holds the "
                "mean and std of its rewards on the training pairs (PPO normalises with them).",
        base_model=settings.backbone, library="transformers", tags=["reward-model"],
        pipeline_tag="text-classification",
        training={"epochs": settings.epochs, "learning rate": settings.lr, "batch size": settings.batch_size,
                  "margin": settings.margin, "LoRA rank": settings.lora_rank, "max length": settings.max_length,
                  "strategy": settings.strategy, "steps": summary.get("steps")},
        data={"prompts": cfg.data.prompts, "label judge": cfg.label.judge, "constitution": cfg.label.constitution,
              "training pairs": summary.get("train_pairs"), "held-out pairs": summary.get("held_out_pairs")},
        metrics={key: summary.get(key) for key in ("held_out_accuracy", "held_out_accuracy_confident",
                                                   "held_out_reference_accuracy", "held_out_soft_ce",
                                                   "held_out_calibration_mae")},
        run=run_facts(ctx),
        usage=LOAD.format(auto="AutoModelForSequenceClassification"),
    )
