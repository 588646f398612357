"""The report's figures as PNG bytes (matplotlib, Agg): PPO curves and diagnostics, reward and length distributions,
win rate by judge. A figure whose data the run lacks is left out."""
from __future__ import annotations

import io
import math

# PPO diagnostics plotted when logged (GRPO logs kl_loss where PPO logs value_loss), with their titles
DIAGNOSTICS = [("entropy", "policy entropy (per token)"), ("eos_rate", "answers ending with EOS"),
               ("clip_frac", "clipped ratio fraction"), ("value_loss", "value loss"), ("kl_loss", "KL loss (GRPO)"),
               ("approx_kl", "approx. KL to rollout policy")]


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    _figure().close(fig)
    return buf.getvalue()


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r.get("iteration", r.get("step")), r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def ppo_curves(ppo_rows: list[dict]) -> bytes:
    """Reward-model score and KL to the reference over PPO iterations (also saved by the ppo stage)."""
    fig, (a, b) = _figure().subplots(1, 2, figsize=(10, 3.2))
    a.plot(*_series(ppo_rows, "reward_raw"), color="tab:blue")
    a.set(title="PPO: reward-model score", xlabel="iteration")
    b.plot(*_series(ppo_rows, "kl"), color="tab:red")
    b.set(title="PPO: KL to reference (per sequence)", xlabel="iteration")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    return _png(fig)


def ppo_diagnostics(ppo_rows: list[dict]) -> bytes | None:
    """Entropy, EOS rate, clip fraction, value loss and approximate KL over iterations; None when none was logged."""
    logged = [(key, title) for key, title in DIAGNOSTICS if any(key in r for r in ppo_rows)]
    if not logged:
        return None
    cols = min(3, len(logged))
    rows = math.ceil(len(logged) / cols)
    fig, axes = _figure().subplots(rows, cols, figsize=(10, 2.6 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, logged):
        ax.plot(*_series(ppo_rows, key), color="tab:purple")
        ax.set(title=f"PPO: {title}", xlabel="iteration")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(logged):]:
        ax.set_visible(False)
    return _png(fig)


def distributions(examples: list[dict]) -> bytes | None:
    """Reward-model score and response length of both policies' answers; None when the examples lack them."""
    keys = ("reward_reference", "reward_tuned", "length_reference", "length_tuned")
    rows = [x for x in examples if all(isinstance(x.get(k), (int, float)) for k in keys)]
    if not rows:
        return None
    fig, (a, b) = _figure().subplots(1, 2, figsize=(10, 3.2))
    for ax, what, title, xlabel in ((a, "reward", "reward-model score (normalised)", "reward"),
                                    (b, "length", "response length (tokens)", "tokens")):
        ax.hist([x[f"{what}_reference"] for x in rows], bins=30, alpha=0.6, label="start", color="tab:gray")
        ax.hist([x[f"{what}_tuned"] for x in rows], bins=30, alpha=0.6, label="tuned", color="tab:green")
        ax.set(title=title, xlabel=xlabel)
        ax.legend()
    return _png(fig)


def win_rates(judges: dict) -> bytes | None:
    """Each judge's win rate with its 95% interval and its length-controlled win rate."""
    names = [n for n, j in judges.items() if isinstance(j.get("win_rate"), (int, float)) and j.get("win_rate_ci95")]
    if not names:
        return None
    fig, ax = _figure().subplots(figsize=(10, 0.9 + 0.6 * len(names)))
    rates = [judges[n]["win_rate"] for n in names]
    # Clamped at 0: an interval that does not hold its rate (hand-edited numbers) draws no bar rather than failing.
    lo = [max(0.0, judges[n]["win_rate"] - judges[n]["win_rate_ci95"][0]) for n in names]
    hi = [max(0.0, judges[n]["win_rate_ci95"][1] - judges[n]["win_rate"]) for n in names]
    ax.barh(names, rates, xerr=[lo, hi], color="tab:green", alpha=0.7, capsize=5, label="win rate (95% CI)")
    controlled = [n for n in names if isinstance(judges[n].get("win_rate_length_controlled"), (int, float))]
    ax.scatter([judges[n]["win_rate_length_controlled"] for n in controlled], controlled, color="black", zorder=3,
               label="length-controlled")
    ax.axvline(0.5, color="tab:red", linestyle="--", linewidth=1)
    ax.set(xlim=(0, 1), title="tuned vs start: win rate by judge")
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def plots(metrics: dict, examples: list[dict], ppo_rows: list[dict]) -> dict[str, bytes]:
    """Every figure the run's files allow, by file name (the order they appear in on the page)."""
    out = {"ppo_reward_kl.png": ppo_curves(ppo_rows) if ppo_rows else None,
           "ppo_diagnostics.png": ppo_diagnostics(ppo_rows),
           "distributions.png": distributions(examples),
           "win_rate.png": win_rates(metrics["judges"])}
    return {name: png for name, png in out.items() if png is not None}
