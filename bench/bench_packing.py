"""Packed forwards (rlaif/models/packing.py) against the padded forward, on one PPO rollout, pass by pass: the
update's forward and backward of a 16-row micro-batch (all weights), the reference's forward of 16 rows and the
reward model's scoring of 16 rows, each timed with packing on and off in alternating rounds in one process (the
same batch, the same weights), so the difference is the packing and not the machine's drift between runs.

The rollout is the stage's own (bench_ppo.py's models, 64 training prompts, fixed-length responses of 48 tokens);
padding is what its micro-batches carry (left-padded prompts of different lengths).

    .venv/bin/python bench/bench_packing.py [--size h256x4] [--rounds 7] [--append]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import OVERRIDES, SIZES, ours_setup, shared_models  # noqa: E402
from common import publish  # noqa: E402

from rlaif.distributed import clock  # noqa: E402
from rlaif.models.packing import packs as PACKS  # noqa: E402

ROWS = 16


def passes(policy, reference_logprobs, reward_fn, part: dict, prompts: list[str]) -> dict:
    """name -> a callable running that pass once on the micro-batch `part` (whose prompts' texts are `prompts`)."""
    args = (part["prompt_ids"], part["prompt_mask"], part["responses"], part["mask"])

    def update():
        logprobs, _, values = policy(*args)
        (logprobs.sum() + values.sum()).backward()

    def reference():
        with torch.no_grad():
            reference_logprobs(policy, *args)

    def score():
        reward_fn.score_tokens(prompts, part["responses"], part["mask"], batch_size=ROWS)

    return {"update forward+backward": update, "reference forward": reference, "reward scoring": score}


def switch(packed: bool) -> None:
    """Packed forwards on or off for every model (off: the padded forward, which the registered attention runs as
    plain SDPA)."""
    import rlaif.models.generation
    import rlaif.models.packing

    rlaif.models.generation.packs = rlaif.models.packing.packs = PACKS if packed else (lambda model: False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="h256x4", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    from rlaif.io.prompts import split
    from rlaif.stages import ppo

    policy_dir, rm_dir = shared_models(Path("runs"), a.size)
    cfg, device, tokenizer, policy, reference_logprobs, reward_fn, _, amp = ours_setup(
        [*OVERRIDES, "ppo.lora_rank=0", "ppo.fixed_length=true", f"policy.model={policy_dir}"], rm_dir)
    rows = split(cfg.data, "train")[:64]
    batch, _, _ = ppo.rollout(cfg, policy, reference_logprobs, tokenizer, reward_fn, rows, seed=0, device=device,
                              kl_coef=cfg.ppo.kl_coef, amp=amp)
    prompts = [row["prompt"] for row in rows[:ROWS]]
    part = {k: v[:ROWS] for k, v in batch.items()}
    real = int(part["prompt_mask"].sum() + part["mask"].sum())
    seconds = {(name, packed): [] for name in passes(policy, reference_logprobs, reward_fn, part, prompts)
               for packed in (False, True)}
    for _ in range(a.rounds):
        for packed in (False, True):
            switch(packed)
            for name, run in passes(policy, reference_logprobs, reward_fn, part, prompts).items():
                run()  # once untimed: the other mode's buffers are not this one's
                start = clock()
                run()
                seconds[(name, packed)].append(clock() - start)
    switch(True)
    width = part["prompt_ids"].shape[1] + part["responses"].shape[1]
    lines = ["| pass (16 rows) | padded ms | packed ms | packed / padded |", "|---|---|---|---|"]
    for name in passes(policy, reference_logprobs, reward_fn, part, prompts):
        padded, packed = (statistics.median(seconds[(name, mode)]) * 1e3 for mode in (False, True))
        lines.append(f"| {name} | {padded:.1f} | {packed:.1f} | {packed / padded:.2f} |")
    title = (f"Packed vs padded forwards, policy {a.size}, all weights, one micro-batch of {ROWS} rows ({real:,} real "
             f"of {ROWS * width:,} padded tokens), medians of {a.rounds} alternating rounds")
    publish(title, "\n".join(lines) + "\n", a.append)


if __name__ == "__main__":
    main()
