"""Padding arithmetic on rollout batches: prompts are left-padded, responses right-padded, and a micro-batch is cut
to the columns its own rows use."""
from __future__ import annotations

import torch


def pad_right(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def pad_left(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)


def trimmed(batch: dict, index=slice(None)) -> dict:
    """Those rows of a batch of [rows, columns] tensors without the columns that are padding in all of them: left of
    their longest prompt, right of their longest response. Exact up to floating-point rounding (other shapes): those
    positions are masked out of attention, or come after every real token."""
    picked = {k: v[index] for k, v in batch.items()}
    start = int(picked["prompt_mask"].any(0).int().argmax())
    real = picked["mask"].any(0).nonzero()
    width = int(real.max()) + 1 if len(real) else 1
    return {k: v[:, start:] if k.startswith("prompt") else v[:, :width] for k, v in picked.items()}


def minibatch_order(total: int, group: int, seed: int) -> torch.Tensor:
    """A seeded order of a rollout's `total` rows for one epoch's minibatches, whole groups of `group` adjacent rows
    at a time (a GRPO prompt's samples stay together, so a packed forward runs the prompt once for them); `group` 1
    is torch.randperm's order of the rows."""
    if total % group:
        raise ValueError(f"{total} rows are not whole groups of {group}")
    groups = torch.randperm(total // group, generator=torch.Generator().manual_seed(seed))
    return (groups[:, None] * group + torch.arange(group)).reshape(-1)
