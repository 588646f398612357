"""Memory of train_rm and ppo at the 28M-parameter size with each optimizer the stages can name (train_rm.optimizer,
ppo.optimizer): AdamW, Adafactor, and bitsandbytes' 8-bit AdamW where bitsandbytes is installed.

The 28M size is bench_ppo.py's h512x8 Llama. Both train all weights (with LoRA the optimizer state is small whichever
it is): train_rm trains the 28M Llama sequence classifier (bench_ppo's reward model) on synthetic labels through the
stage itself; ppo trains the 28M policy with lora_rank 0 (plus its frozen reference copy and the 28M reward model)
through the stage's rollout and update. Each measurement is its own process and takes a few optimizer steps; it
reports the optimizer state's bytes (the sum of its tensors' sizes, after the last step), the peak RSS over the
training steps above the RSS after the imports, and the process's whole peak RSS (VmHWM, as bench/common.py
measures it). Workers alternate within each trial; medians and ranges over --trials.

    flock /tmp/rlaif-heavy.lock .venv/bin/python bench/optimizer_memory.py --trials 3 --append
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import ours_setup, shared_models  # noqa: E402
from common import peak_rss_mib, publish, report_result, side_by_side  # noqa: E402

SIZE = "h512x8"
RM_PAIRS, RM_BATCH, RM_MAX_LEN = 40, 8, 64  # 36 training pairs: 4 optimizer steps
PPO_ITERATIONS, ROLLOUT, MINIBATCH, RESPONSE_LEN = 2, 16, 8, 24  # 2 optimizer steps per iteration
KEYS = ("state_mib", "train_rss_above_imports_mib", "peak_rss_mib")


def optimizers() -> list[str]:
    return ["adamw", "adafactor"] + (["adamw_8bit"] if importlib.util.find_spec("bitsandbytes") else [])


def import_everything() -> float:
    """Every module either worker uses, so that both start from the same baseline; returns that RSS."""
    import logging

    import peft  # noqa: F401  (imports bitsandbytes where it is installed, in every worker alike)
    import transformers  # noqa: F401

    import rlaif.runner  # noqa: F401
    import rlaif.stages.ppo  # noqa: F401
    import rlaif.stages.train_rm  # noqa: F401

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    return peak_rss_mib()


def state_mib(optimizer) -> float:
    import torch

    state = getattr(optimizer, "optimizer", optimizer).state  # DeepSpeed wraps the torch optimizer
    return sum(t.nbytes for s in state.values() for t in s.values() if torch.is_tensor(t)) / 2**20


def watch_steps(probe: dict) -> None:
    """Records the optimizer state and the peak RSS after every optimizer step of the stage in this process."""
    from rlaif import training

    step = training.Engine.step

    def recorded(engine):
        norm = step(engine)
        probe.update(state_mib=state_mib(engine.optimizer), train_peak=peak_rss_mib())
        return norm

    training.Engine.step = recorded


def labelled_run(work: Path) -> Path:
    """A run directory holding only a label stage: train_rm's test labels (the response naming the topic wins)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "stages"))
    from test_train_rm import write_labels

    run = work / "bench-optim"
    shutil.rmtree(run, ignore_errors=True)
    write_labels(work, run.name, n=RM_PAIRS, shard_size=RM_PAIRS)
    return run


def worker_train_rm(work: Path, optimizer: str) -> dict:
    baseline = import_everything()
    from rlaif.config import load_config
    from rlaif.runner import run_stage

    _, rm_dir = shared_models(work, SIZE)
    run = work / "bench-optim"
    shutil.rmtree(run / "train_rm", ignore_errors=True)
    probe: dict = {}
    watch_steps(probe)
    cfg = load_config("configs/demo.yaml", [
        f"storage.root={run.parent}", f"run_id={run.name}", f"train_rm.backbone={rm_dir}",
        f"train_rm.batch_size={RM_BATCH}", f"train_rm.max_length={RM_MAX_LEN}", "train_rm.checkpoint_every=0",
        f"train_rm.optimizer={optimizer}", "train_rm.nproc=1"])  # run in this process
    run_stage(cfg, "train_rm")
    return {"state_mib": probe["state_mib"], "train_rss_above_imports_mib": probe["train_peak"] - baseline}


def worker_ppo(work: Path, optimizer: str) -> dict:
    baseline = import_everything()
    from rlaif.io.prompts import split
    from rlaif.stages import ppo

    policy_dir, rm_dir = shared_models(work, SIZE)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup([
        f"policy.model={policy_dir}", f"ppo.rollout_batch_size={ROLLOUT}", f"ppo.minibatch_size={MINIBATCH}",
        "ppo.ppo_epochs=1", f"ppo.max_new_tokens={RESPONSE_LEN}", "ppo.lora_rank=0", "ppo.checkpoint_every=0",
        f"ppo.optimizer={optimizer}"], rm_dir)
    rows = split(cfg.data, "train")
    for it in range(PPO_ITERATIONS):
        chunk = [rows[(it * ROLLOUT + k) % len(rows)] for k in range(ROLLOUT)]
        batch, _, _ = ppo.rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, chunk, seed=it, device=device,
                                  kl_coef=cfg.ppo.kl_coef, amp=amp)
        ppo.update(cfg, engine, ppo.whiten_advantages(cfg, batch), seed=it, kl_coef=cfg.ppo.kl_coef, amp=amp)
    return {"state_mib": state_mib(engine.optimizer), "train_rss_above_imports_mib": peak_rss_mib() - baseline}


STAGES = {"train_rm": worker_train_rm, "ppo": worker_ppo}


def table(trials: list[dict[str, dict[str, float]]]) -> str:
    """One row per stage and optimizer: medians, with the range over trials in brackets."""
    def cell(who: str, key: str) -> str:
        values = [t[who][key] for t in trials]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    lines = ["| stage | optimizer | optimizer state (MiB) | training peak RSS above imports (MiB) | "
             "process peak RSS (MiB) |", "|---|---|---|---|---|"]
    for who in trials[0]:
        stage, optimizer = who.split(":")
        lines.append(f"| {stage} | {optimizer} | {statistics.median(t[who]['state_mib'] for t in trials):.1f} | "
                     f"{cell(who, 'train_rss_above_imports_mib')} | {cell(who, 'peak_rss_mib')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--worker", help="STAGE:OPTIMIZER")
    p.add_argument("--work", default="runs")
    p.add_argument("--append", action="store_true", help="add the table to BENCHMARKS.md")
    a = p.parse_args()
    work = Path(a.work)
    if a.worker:
        stage, optimizer = a.worker.split(":")
        report_result(STAGES[stage](work, optimizer))
        return
    work.mkdir(exist_ok=True)
    shared_models(work, SIZE)
    labelled_run(work)
    workers = tuple(f"{stage}:{optimizer}" for stage in STAGES for optimizer in optimizers())
    # One side_by_side per trial keeps every trial's numbers (it returns medians), in the same alternating order.
    trials = [side_by_side(__file__, workers, 1, ["--work", str(work)], KEYS) for _ in range(a.trials)]
    publish(f"Optimizer memory at 28M parameters, all weights trained (median and range of {a.trials} trials)",
            table(trials), a.append)


if __name__ == "__main__":
    main()
