"""The preference model's loss: Bradley-Terry on soft labels, with Llama 2's margin."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(reward_a: torch.Tensor, reward_b: torch.Tensor, p_a: torch.Tensor,
                       margin: float = 0.0) -> torch.Tensor:
    """Mean of BCE(sigmoid(r_a - r_b - margin * (2 p_a - 1)), p_a): the soft-label Bradley-Terry likelihood. The margin
    term demands a wider reward gap on confident labels (0 turns it off; 0 at p_a = 0.5)."""
    return F.binary_cross_entropy_with_logits(reward_a - reward_b - margin * (2 * p_a - 1), p_a)
