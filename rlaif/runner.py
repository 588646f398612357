"""Local runner: runs the stage graph in order, each stage as its own process exactly as a container would run it
(torchrun for the training stages). Stages whose manifest matches their config and inputs are skipped (cache hits),
so re-running after a failure or a kill continues from the first incomplete stage."""
from __future__ import annotations

import os

from rlaif.config import PipelineConfig
from rlaif.errors import UserError
from rlaif.graph import topological_order
from rlaif.io import manifest, storage
from rlaif.orchestration import launch
from rlaif.stages import common


def run(cfg: PipelineConfig) -> dict:
    config_url = launch.prepare(cfg)
    run_url = common.run_url(cfg)
    print(f"run_dir: {run_url}", flush=True)
    for stage in topological_order():
        launch.launch(cfg, stage.name, config_url)
    result = manifest.require(storage.join(run_url, "evaluate"), "evaluate")["summary"]
    lo, hi = result["win_rate_ci95"]
    print(f"evaluation: win rate {result['win_rate']:.3f} [95% CI {lo:.3f}, {hi:.3f}], length-controlled "
          f"{result['win_rate_length_controlled']:.3f}, on {result['n_prompts']} held-out prompts; "
          f"reward {result['reward_policy_mean']:.3f} (tuned) vs {result['reward_reference_mean']:.3f} (start); "
          f"KL to reference {result['kl_to_reference']:.3f}")
    for name, j in result["judges"].items():
        if name != "training":
            print(f"evaluation, judge '{name}': win rate {j['win_rate']:.3f} "
                  f"[95% CI {j['win_rate_ci95'][0]:.3f}, {j['win_rate_ci95'][1]:.3f}]")
    print(f"report: {storage.join(run_url, 'evaluate', 'report.html')}")
    return {"run_dir": run_url, "evaluation": result}


def run_stage(cfg: PipelineConfig, name: str, part_index: int = 0, num_parts: int = 1) -> None:
    """What a container runs: one stage, skipped if its output already exists for this config and inputs. A stage
    split across pods (generate) runs part `part_index` of `num_parts`."""
    import importlib

    from rlaif.distributed import avoid_per_shape_attention_plans, die_with_parent
    from rlaif.models.loading import quiet_transformers

    die_with_parent()
    quiet_transformers()
    avoid_per_shape_attention_plans()
    storage.configure(cfg.storage.endpoint_url)
    if num_parts > 1 and name != "generate":
        raise UserError(f"--num-shards splits stage 'generate' only, not '{name}'")
    if not 0 <= part_index < num_parts:
        raise UserError(f"--shard-index {part_index} is outside 0..{num_parts - 1} (--num-shards {num_parts})")
    ctx = common.context(cfg, name, part_index, num_parts)
    first_rank = int(os.environ.get("RANK", "0")) == 0  # the process group is not up yet: torchrun's env says
    # `rlaif launch` checked the cache for this key already; a pod running `rlaif stage` alone checks it here.
    if os.environ.get("RLAIF_CACHE_CHECKED") != ctx.config_hash and common.cached(ctx):
        if first_rank:
            print(f"[{name}] cache hit: output exists for this config and inputs, skipped")
        return
    module = importlib.import_module(f"rlaif.stages.{name}")
    if hasattr(module, "invalidate"):  # a stage split into parts removes only its own part's output
        module.invalidate(ctx)
    elif first_rank:
        manifest.invalidate(ctx.url)
    module.run(ctx)

