"""Evaluation statistics: win-rate intervals and the length-controlled win rate."""
from __future__ import annotations

import math

import torch


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (ties enter as half successes)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def sample_std(values: torch.Tensor) -> float | None:
    """The sample standard deviation (n - 1), or None for fewer than two values, where it is undefined (torch gives
    NaN and a warning)."""
    return values.std().item() if values.numel() > 1 else None


def length_controlled_win_rate(outcomes, length_a, length_b, l2: float = 1e-3, iters: int = 50) -> float:
    """Win rate of A over B with the effect of length removed (the idea of AlpacaEval's length control).

    Fits P(A wins) = sigmoid(w0 + w1 * tanh((len_a - len_b) / std)) to the outcomes (1 win, 0 loss, 0.5 tie) by
    Newton's method with a small L2 penalty (keeps separable data finite), and returns sigmoid(w0): the predicted
    win rate when both answers are equally long."""
    y = torch.as_tensor(outcomes, dtype=torch.float64)
    diff = torch.as_tensor(length_a, dtype=torch.float64) - torch.as_tensor(length_b, dtype=torch.float64)
    scale = diff.std() if len(diff) > 1 and diff.std() > 0 else torch.tensor(1.0, dtype=torch.float64)
    x = torch.stack([torch.ones_like(diff), torch.tanh(diff / scale)], dim=1)
    w = torch.zeros(2, dtype=torch.float64)
    for _ in range(iters):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - y) + l2 * len(y) * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + l2 * len(y) * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if step.abs().max() < 1e-10:
            break
    return torch.sigmoid(w[0]).item()


def diversity(responses: list[str]) -> dict:
    """How varied a policy's answers are (a collapsed policy says one thing to everyone): the share of the most common
    answer (whitespace-normalised) and distinct-n, the unique word n-grams over all n-grams (Li et al. 2016)."""
    normalised = [" ".join(r.split()) for r in responses]
    counts: dict[str, int] = {}
    for text in normalised:
        counts[text] = counts.get(text, 0) + 1
    top = max(counts, key=counts.get) if counts else ""
    out = {"top_response_share": counts.get(top, 0) / max(len(responses), 1), "top_response": top,
           "unique_responses": len(counts)}
    for n in (1, 2):
        grams = [tuple(words[i : i + n]) for words in (t.lower().split() for t in normalised)
                 for i in range(len(words) - n + 1)]
        out[f"distinct_{n}"] = len(set(grams)) / len(grams) if grams else 0.0
    return out
