"""How a PPO iteration's cost grows with model size, rollout batch and response length, per phase (generate, score,
reference, update), with the stage's own rollout() and update() in one process. Policies and reward models are
random Llamas on the demo tokenizer (bench_ppo.shared_models), so every response runs to max_new_tokens and the
token counts are exact. Three points per axis around the base point (h128x2, batch 64, 48 tokens). Each point runs
in its own process (its own peak RSS): one warm-up iteration, then the median of --iterations.

    .venv/bin/python bench/bench_ppo_scaling.py [--iterations 3] [--append] [--points N] [--reward-inputs text]

RLAIF_DECODER=generate measures the sampler before the static decoder became the CPU default.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import EPOCHS, LR, ours_setup, shared_models  # noqa: E402
from common import publish, report_result, side_by_side  # noqa: E402

from rlaif.distributed import clock  # noqa: E402

BASE = {"size": "h128x2", "batch": 64, "tokens": 48}
POINTS = [dict(BASE, **change) for change in (
    {}, {"size": "h256x4"}, {"size": "h512x8"},
    {"batch": 32}, {"batch": 128},
    {"tokens": 24}, {"tokens": 96},
)]
PHASES = ("generate_s", "score_s", "reference_s", "update_s")
LORA_RANK = 16  # as the demo trains


def name(point: dict) -> str:
    return f"{point['size']},{point['batch']},{point['tokens']}"


def worker(work: Path, point_name: str, iterations: int, reward_inputs: str) -> dict:
    size, batch_size, tokens = point_name.split(",")
    batch_size, tokens = int(batch_size), int(tokens)
    policy_dir, rm_dir = shared_models(work, size)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup([
        f"policy.model={policy_dir}", f"ppo.rollout_batch_size={batch_size}", "ppo.minibatch_size=16",
        f"ppo.ppo_epochs={EPOCHS}", f"ppo.max_new_tokens={tokens}", f"ppo.lora_rank={LORA_RANK}", f"ppo.lr={LR}",
        "ppo.checkpoint_every=0", f"ppo.reward_inputs={reward_inputs}"], rm_dir)
    result = phase_medians(cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp, iterations)
    result["params_m"] = sum(p.numel() for p in policy.parameters()) / 1e6
    return result


def phase_medians(cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp,
                  iterations: int) -> dict:
    """The stage's rollout() and update() on ppo.rollout_batch_size training prompts per iteration: one warm-up
    iteration, then the median seconds of each phase (and response tokens) over `iterations`."""
    from rlaif.io.prompts import split
    from rlaif.stages import ppo

    rows, per_iteration, batch_size = split(cfg.data, "train"), [], cfg.ppo.rollout_batch_size
    for it in range(iterations + 1):  # the first is a warm-up
        chunk = [rows[(it * batch_size + k) % len(rows)] for k in range(batch_size)]
        batch, _, timings = ppo.rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, chunk, seed=it,
                                        device=device, kl_coef=cfg.ppo.kl_coef, amp=amp)
        start = clock()
        ppo.update(cfg, engine, ppo.whiten_advantages(cfg, batch), seed=it, kl_coef=cfg.ppo.kl_coef, amp=amp)
        timings["update_s"] = clock() - start
        timings["response_tokens"] = batch["mask"].sum().item()
        if it:
            per_iteration.append(timings)
    return {k: statistics.median(t[k] for t in per_iteration) for k in (*PHASES, "response_tokens")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--worker")
    p.add_argument("--work", default="runs")
    p.add_argument("--append", action="store_true")
    p.add_argument("--points", type=int, default=len(POINTS), help="measure only the first N points")
    p.add_argument("--reward-inputs", choices=["auto", "text"], default="auto", help="ppo.reward_inputs")
    a = p.parse_args()
    points = POINTS[: a.points]
    if a.worker:
        report_result(worker(Path(a.work), a.worker, a.iterations, a.reward_inputs))
        return
    Path(a.work).mkdir(exist_ok=True)
    for point in points:
        shared_models(Path(a.work), point["size"])
    med = side_by_side(__file__, tuple(name(pt) for pt in points), 1,
                       ["--work", a.work, "--iterations", str(a.iterations), "--reward-inputs", a.reward_inputs],
                       (*PHASES, "response_tokens", "params_m"))
    base = med[name(POINTS[0])]
    base_total = sum(base[k] for k in PHASES)
    lines = ["| policy | params | rollout batch | max new tokens | tokens sampled | generate s | score s | "
             "reference s | update s | iteration s | vs base | samples/s | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in points:
        r = med[name(point)]
        total = sum(r[k] for k in PHASES)
        lines.append(f"| {point['size']} | {r['params_m']:.2f}M | {point['batch']} | {point['tokens']} | "
                     f"{r['response_tokens']:,.0f} | "
                     + " | ".join(f"{r[k]:.2f}" for k in PHASES)
                     + f" | {total:.2f} | {total / base_total:.2f}x | {point['batch'] / total:.1f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    publish(f"PPO iteration cost by phase against model size, batch and response length (median of {a.iterations} "
            f"iterations after a warm-up, one process, decoder {os.environ.get('RLAIF_DECODER', 'auto')}, rewards on "
            f"{'token ids' if a.reward_inputs == 'auto' else 'text'})",
            "\n".join(lines), a.append)


if __name__ == "__main__":
    main()
