"""Reward-model distillation: the student's loss against the teacher's scores, and how well it agrees with them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, scale: float, ranking_weight: float) -> torch.Tensor:
    """MSE to the teacher's scores plus ranking_weight x the pairwise logistic loss over every pair of the batch
    the teacher orders (softplus(-(s_i - s_j)) where t_i > t_j), both in units of `scale` (the teacher's score std):
    PPO whitens or normalises rewards, so the order and spacing of scores matter more than their offset."""
    s, t = student / scale, teacher / scale
    loss = F.mse_loss(s, t)
    if ranking_weight and len(s) > 1:
        ahead = t[:, None] > t[None, :]  # ahead[i, j]: the teacher scores i above j
        if ahead.any():
            margin = (s[:, None] - s[None, :])[ahead]
            loss = loss + ranking_weight * F.softplus(-margin).mean()
    return loss


def pairwise_agreement(student: torch.Tensor, teacher: torch.Tensor, groups: list) -> tuple[int, int]:
    """(pairs ordered alike by both, pairs compared) over every two items of a group (the responses to one prompt,
    or a labeled pair) that the teacher does not tie."""
    members: dict = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    agree = total = 0
    for indices in members.values():
        idx = torch.tensor(indices)
        s, t = student[idx], teacher[idx]
        ordered = t[:, None] > t[None, :]
        agree += int(((s[:, None] > s[None, :]) & ordered).sum())
        total += int(ordered.sum())
    return agree, total


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denominator) if denominator > 0 else 0.0


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 with ties given their mean rank (as Spearman's correlation needs)."""
    order = torch.argsort(x, stable=True)
    ranked = torch.empty(len(x), dtype=torch.float64)
    ranked[order] = torch.arange(len(x), dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    mean_rank = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranked)
    mean_rank /= torch.bincount(inverse, minlength=len(values)).double()
    return mean_rank[inverse]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    return pearson(ranks(x), ranks(y))
