"""Local runner: runs the stage graph in order, each stage as its own process exactly as a container would run it
(torchrun for the training stages). Stages whose manifest matches their config and inputs are skipped (cache hits),
so re-running after a failure or a kill continues from the first incomplete stage."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from rlaif.config import PipelineConfig, dump_config
from rlaif.graph import Stage, topological_order
from rlaif.io import manifest, storage
from rlaif.io.prompts import load_prompts
from rlaif.stages import common


class StageFailed(Exception):
    def __init__(self, stage: str, code: int):
        super().__init__(f"stage '{stage}' failed with exit code {code} (its output is above)")
        self.code = code


def launch_command(stage: Stage, config_url: str, cfg: PipelineConfig) -> list[str]:
    """graph.py's argv, with `rlaif` as this interpreter and torchrun in front for the training stages."""
    argv = [sys.executable, "-m", "rlaif", *stage.argv(config_url)[1:]]
    if stage.resources.torchrun:
        nproc = getattr(cfg, stage.name).nproc
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv[1:]]
    return argv


def preflight(cfg: PipelineConfig) -> str:
    """Everything a user can get wrong that is cheap to check, before any stage starts."""
    storage.configure(cfg.storage.endpoint_url)
    root = storage.normalize(cfg.storage.root)
    storage.check_writable(root)
    load_prompts(cfg.data)
    return storage.join(root, cfg.run_id)


def run(cfg: PipelineConfig) -> dict:
    run_url = preflight(cfg)
    print(f"run_dir: {run_url}", flush=True)
    config_url = storage.join(run_url, "config.yaml")
    storage.write_bytes_atomic(config_url, dump_config(cfg).encode())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    timings = {}
    for stage in topological_order():
        ctx = common.context(cfg, stage.name)
        if common.cached(ctx):
            print(f"[{stage.name}] cache hit: output exists for this config and inputs, skipped", flush=True)
            continue
        cmd = launch_command(stage, config_url, cfg)
        print(f"[{stage.name}] running: {' '.join(cmd[1:])}", flush=True)
        start = time.time()
        stage_env = env
        if stage.resources.torchrun and "OMP_NUM_THREADS" not in env:  # ranks share this machine's cores
            stage_env = dict(env, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // getattr(cfg, stage.name).nproc)))
        code = subprocess.call(cmd, env=stage_env)
        if code != 0:
            raise StageFailed(stage.name, code)
        timings[stage.name] = time.time() - start
        print(f"[{stage.name}] done in {timings[stage.name]:.1f}s", flush=True)
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
    return {"run_dir": run_url, "timings": timings, "evaluation": result}


def run_stage(cfg: PipelineConfig, name: str) -> None:
    """What a container runs: one stage, skipped if its output already exists for this config and inputs."""
    import importlib

    from rlaif.models.loading import quiet_transformers

    quiet_transformers()
    storage.configure(cfg.storage.endpoint_url)
    ctx = common.context(cfg, name)
    first_rank = int(os.environ.get("RANK", "0")) == 0  # the process group is not up yet: torchrun's env says
    if common.cached(ctx):
        if first_rank:
            print(f"[{name}] cache hit: output exists for this config and inputs, skipped")
        return
    if first_rank:
        manifest.invalidate(ctx.url)
    module = importlib.import_module(f"rlaif.stages.{name}")
    module.run(ctx)

