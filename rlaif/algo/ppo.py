"""PPO math for language models, single-device and vectorized (no Python loop over time steps).

Tensors are [batch, time], right-padded; `mask` is 1 on response tokens and 0 on padding. Cross-rank statistics
(advantage whitening) take an optional `all_reduce` so the same code runs with and without torch.distributed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1e-8)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """(x - mean) / std over the valid entries (of all ranks when `all_reduce` sums across them); padding -> 0."""
    stats = torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()]).double()
    if all_reduce is not None:
        stats = all_reduce(stats)
    total, total_sq, count = stats
    mean = total / count
    var = (total_sq / count - mean * mean) * count / (count - 1).clamp(min=1)  # unbiased, like torch.var
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + 1e-8)
    if not shift_mean:
        out = out + mean.to(x.dtype)
    return out * mask


def _discount_matrix(steps: int, factor: float, device, dtype) -> torch.Tensor:
    """M[k, t] = factor**(k - t) for k >= t, else 0, so (x @ M)[t] = sum_{k>=t} factor**(k-t) x[k]."""
    idx = torch.arange(steps, device=device)
    power = (idx[:, None] - idx[None, :]).to(dtype)
    return torch.where(power >= 0, torch.tensor(factor, dtype=dtype, device=device) ** power.clamp(min=0),
                       torch.zeros((), dtype=dtype, device=device))


def discounted_suffix_sum(x: torch.Tensor, factor: float, block: int = 64) -> torch.Tensor:
    """y[t] = sum_{k>=t} factor**(k-t) x[k] along the last axis, blockwise: a small discount-matrix product inside
    each block of `block` steps, then one carry per block (T/block steps of a loop, not T)."""
    batch, steps = x.shape
    pad = (-steps) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(batch, -1, block)
    within = blocks @ _discount_matrix(block, factor, x.device, x.dtype)  # suffix sums inside each block
    jump = factor**block
    carry = torch.zeros(batch, device=x.device, dtype=x.dtype)
    carries = []
    for j in reversed(range(blocks.shape[1])):  # suffix sum from the start of block j+1 onwards
        carries.append(carry)
        carry = within[:, j, 0] + jump * carry
    carries = torch.stack(carries[::-1], dim=1)
    decay = factor ** (block - torch.arange(block, device=x.device, dtype=x.dtype))  # factor**(distance to next block)
    return (within + carries[:, :, None] * decay).reshape(batch, -1)[:, :steps]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: delta_t = r_t + gamma V_{t+1} - V_t (V past the last token = 0),
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V. Padding positions get 0 in both outputs."""
    mask = mask.to(values.dtype)
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:] * mask[:, 1:]
    deltas = (rewards + gamma * next_values - values) * mask
    # Blockwise products replace the backward recursion over time; at least float32 (bf16 sums drift), never demoted.
    wide = torch.promote_types(deltas.dtype, torch.float32)
    advantages = discounted_suffix_sum(deltas.to(wide), gamma * lam).to(values.dtype) * mask
    returns = (advantages + values) * mask
    return advantages, returns


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || reference) estimators on sampled tokens (Schulman's k1, k2, k3)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # exp(ref - logp) - 1 - (ref - logp) >= 0
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


def token_rewards(score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef * KL_t, plus the sequence score at the LAST REAL response token (never on padding)."""
    rewards = -kl_coef * kl * mask
    last = (mask.long().cumsum(1) == mask.long().sum(1, keepdim=True)) & mask.bool()
    return rewards + last.to(rewards.dtype) * score[:, None]


def token_average(x: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Mean over valid tokens, or their sum divided by `normalizer` (the token count of a whole minibatch that is
    split over micro-batches and ranks, so every split gives the same gradient)."""
    return masked_mean(x, mask) if normalizer is None else masked_sum(x, mask) / normalizer


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps: float,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate: average over valid tokens of -min(rho A, clip(rho, 1-eps, 1+eps) A)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = token_average(-torch.minimum(unclipped, clipped), mask, normalizer)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).float(), mask).item(),
            "approx_kl": masked_mean(0.5 * (logprobs - old_logprobs).square(), mask).item(),
        }
    return loss, stats


def value_loss(values, old_values, returns, mask, clip: float, normalizer: float | None = None) -> torch.Tensor:
    """0.5 * average over valid tokens of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * token_average(torch.maximum((values - returns).square(), (clipped - returns).square()), mask,
                               normalizer)


def group_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's score relative to the other responses to the same prompt, (s - mean) / (std + eps) over
    its group (rows [g*k, (g+1)*k) are one prompt's k samples), given to every valid token of the response."""
    groups = scores.reshape(-1, group_size)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    relative = ((groups - mean) / (std + eps)).reshape(-1)
    return relative[:, None] * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    var_r = masked_mean((returns - masked_mean(returns, mask)).square(), mask)
    resid = returns - values
    var_res = masked_mean((resid - masked_mean(resid, mask)).square(), mask)
    return (1.0 - var_res / var_r.clamp(min=1e-8)).item()


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient so the observed KL tracks `target` (horizon in samples)."""

    def __init__(self, kl_coef: float, target: float, horizon: int = 10000):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.value *= 1.0 + error * n_steps / self.horizon
