"""`gae` (vectorized: one discount-matrix product) against the textbook backward loop over time steps.

Batch 64 x 1024 steps by default, float32, masks with ragged lengths; medians over --trials, the results checked
equal first. Prints a table and, with --append, adds it to BENCHMARKS.md.

    .venv/bin/python bench/bench_gae.py [--batch 64] [--steps 1024] [--trials 5] [--append]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rlaif.algo.ppo import gae
from rlaif.distributed import local_device

sys.path.insert(0, str(Path(__file__).parent))
from common import publish, timed  # noqa: E402


def gae_loop(rewards, values, mask, gamma, lam):
    """The reference form (CleanRL, TRL): last_gae carried backwards one step at a time."""
    batch, steps = rewards.shape
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(batch, device=rewards.device)
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < steps else torch.zeros(batch, device=rewards.device)
        delta = (rewards[:, t] + gamma * next_value - values[:, t]) * mask[:, t]
        last = delta + gamma * lam * last * (mask[:, t + 1] if t + 1 < steps else 0.0)
        advantages[:, t] = last * mask[:, t]
    return advantages, (advantages + values) * mask


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    rewards, values = torch.randn(a.batch, a.steps), torch.randn(a.batch, a.steps)
    lengths = torch.randint(a.steps // 2, a.steps + 1, (a.batch,))
    mask = (torch.arange(a.steps)[None, :] < lengths[:, None]).float()
    rewards, values, mask = rewards.to(local_device()), values.to(local_device()), mask.to(local_device())
    gae(rewards, values, mask, 1.0, 0.95)  # warm-up (kernel launch caches on a GPU)
    ours, loop = gae(rewards, values, mask, 1.0, 0.95), gae_loop(rewards, values, mask, 1.0, 0.95)
    torch.testing.assert_close(ours[0], loop[0], atol=1e-3, rtol=1e-4)
    t_ours = timed(lambda: gae(rewards, values, mask, 1.0, 0.95), a.trials)
    t_loop = timed(lambda: gae_loop(rewards, values, mask, 1.0, 0.95), a.trials)
    table = (f"| gae form | median ms (batch {a.batch} x {a.steps} steps, {a.trials} trials) |\n|---|---|\n"
             f"| rlaif `gae` (blockwise discount-matrix products) | {t_ours * 1e3:.2f} |\n"
             f"| loop over time steps | {t_loop * 1e3:.2f} |\n"
             f"| speed-up | {t_loop / t_ours:.1f}x |\n")
    publish("gae vs the loop form", table, a.append)


if __name__ == "__main__":
    main()
