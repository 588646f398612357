"""GRPO's iteration phase by phase with a group's shared prompt run once and run per sample, alternating in one
process (the same models, the same rollout seed per round), so the difference is the sharing, not the machine's drift.

Shared (the default): minibatches of whole groups (ppo.group_minibatches), packed forwards that run rows' common
prefix once (rlaif/models/packing.py) in the update, the reference pass and the reward model's scoring, and a sampler
prefill that runs each group's prompt once (rlaif/models/decode.py). Per sample: minibatches drawn sample by sample
(TRL's order) and every row's prompt run for that row. `--compare prefill` turns only the sampler's sharing on and off
(the rest shared in both). `--compare lean` runs the sampler's CPU decode steps through transformers' forward and
through rlaif/models/lean_decode.py's step (everything else as the default). bench_grpo.py's workload
(the demo policy with LoRA r16 or all weights, 16 prompts x 4 samples, minibatches of 16, 2 passes, fixed-length
responses of 48 tokens); each round runs one iteration in each mode, the first round untimed.

    .venv/bin/python bench/bench_grpo_phases.py [--size demo] [--lora-rank 16] [--rounds 5] [--compare all|prefill|lean]
        [--append]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_grpo import GROUP, GRPO_OVERRIDES, KL  # noqa: E402
from bench_ppo import OVERRIDES, ROLLOUT, SIZES, ours_setup, shared_models  # noqa: E402
from common import publish  # noqa: E402

import rlaif.models.decode as decode  # noqa: E402
import rlaif.models.packing as packing  # noqa: E402
from rlaif.distributed import clock  # noqa: E402

PHASES = ("generate_s", "score_s", "reference_s", "update_s")
SHARED_OWNERS, PROMPT_RUNS, LEAN_STEP = packing.prefix_owners, decode.prompt_runs, decode.lean_decode_step
# compare: (the column without the change, the column with it, what the table compares)
COMPARISONS = {"all": ("per sample", "shared prompt", "prompts run per sample vs once per group"),
               "prefill": ("prefill per sample", "shared prompt",
                           "the sampler's prefill per sample vs once per group (the rest shared)"),
               "lean": ("transformers' decode step", "lean decode step",
                        "the sampler's CPU decode step through transformers' forward vs the lean step")}


def switch(shared: bool, compare: str) -> None:
    """The default (`shared`: common prefixes run once, the lean decode step), or without the change compared:
    every row owns all of its tokens in the sampler's prefill, and (compare `all`) in the packed forwards; or
    (compare `lean`) the decode steps run transformers' forward."""
    if compare == "lean":
        decode.lean_decode_step = LEAN_STEP if shared else (lambda *_: None)
        return
    decode.prompt_runs = PROMPT_RUNS if shared else (lambda *_: None)
    if compare == "all":
        packing.prefix_owners = SHARED_OWNERS if shared else (
            lambda ids, real: torch.arange(len(ids), device=ids.device)[:, None].expand_as(ids))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="demo", choices=sorted(SIZES))
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compare", default="all", choices=sorted(COMPARISONS))
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    from rlaif.io.prompts import split
    from rlaif.stages import ppo

    policy_dir, rm_dir = shared_models(Path("runs"), a.size)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup(
        [*OVERRIDES, f"ppo.lora_rank={a.lora_rank}", "ppo.fixed_length=true", f"policy.model={policy_dir}",
         *GRPO_OVERRIDES], rm_dir)
    per_sample = (cfg if a.compare != "all"
                  else cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"group_minibatches": False})}))
    prompts = split(cfg.data, "train")[: ROLLOUT // GROUP]
    seconds = {(phase, shared): [] for phase in (*PHASES, "iteration_s") for shared in (False, True)}
    for round_ in range(a.rounds + 1):
        for shared in (False, True):
            switch(shared, a.compare)
            config = cfg if shared else per_sample
            start = clock()
            batch, _, timings = ppo.rollout(config, policy, reference_logprobs, tokenizer, reward_fn, prompts,
                                            seed=round_, device=device, kl_coef=KL, amp=amp)
            update_start = clock()
            ppo.update(config, engine, batch, seed=round_, kl_coef=KL, amp=amp)
            timings.update(update_s=clock() - update_start, iteration_s=clock() - start)
            for phase in (*PHASES, "iteration_s") if round_ else ():  # the first round warms both modes up
                seconds[(phase, shared)].append(timings[phase])
    switch(True, a.compare)
    weights = f"LoRA r{a.lora_rank}" if a.lora_rank else "all weights"
    before, after, what = COMPARISONS[a.compare]
    lines = [f"| phase | {before} s | {after} s | {after} / {before} |", "|---|---|---|---|"]
    for phase in (*PHASES, "iteration_s"):
        alone, shared = (statistics.median(seconds[(phase, mode)]) for mode in (False, True))
        lines.append(f"| {phase.removesuffix('_s')} | {alone:.3f} | {shared:.3f} | {shared / alone:.2f} |")
    title = (f"GRPO phases, {what}, policy {a.size}, {weights}, {ROLLOUT // GROUP} "
             f"prompts x {GROUP} samples, fixed-length responses, medians of {a.rounds} alternating rounds")
    publish(title, "\n".join(lines) + "\n", a.append)


if __name__ == "__main__":
    main()
