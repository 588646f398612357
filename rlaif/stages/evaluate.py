"""Stage 5: the tuned policy against the starting policy on held-out prompts.

Both policies answer each held-out prompt (same sampling settings and seeds). The judge compares the two answers in
both orders (position-debiased); a comparison within `tie_margin` of 0.5 is a tie and counts half. Also: reward-model
scores of both, KL of the tuned policy to the reference on its own samples, response lengths. Writes metrics.json,
examples.jsonl, report.md and report.html.
"""
from __future__ import annotations

import base64
import html
import json
import math

import torch

from rlaif.io import storage
from rlaif.io.prompts import split
from rlaif.models.generation import decode, encode_prompts, response_logits_and_hidden, response_mask, sample, token_logprobs
from rlaif.models.loading import load_causal_lm, load_policy
from rlaif.stages.common import StageContext, model_dir
from rlaif.stages.label import debiased, load_constitution, make_judge, sample_principle
from rlaif.stages.train_rm import batched_rewards, load_reward_model


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (ties enter as half successes)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


@torch.no_grad()
def answer(model, tokenizer, cfg, prompts, seed_base):
    """Responses (text), response token ids and masks, batch by batch with fixed seeds."""
    e = cfg.evaluate
    out = []
    for b in range(0, len(prompts), e.batch_size):
        rows = prompts[b : b + e.batch_size]
        enc = encode_prompts(tokenizer, [cfg.policy.prompt_template.format(prompt=p["prompt"]) for p in rows], "cpu")
        resp = sample(model, tokenizer, enc, max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=seed_base + b)
        mask = response_mask(resp, tokenizer.eos_token_id)
        out.append((enc, resp, mask, decode(tokenizer, resp, mask)))
    return out


@torch.no_grad()
def kl_to_reference(tuned, reference, batches, temperature) -> tuple[float, float]:
    """Mean per-sequence and per-token KL(tuned || reference), estimated on the tuned policy's own samples (k1)."""
    seq_kl, tokens = [], 0.0
    for enc, resp, mask, _ in batches:
        args = (enc["input_ids"], enc["attention_mask"], resp, mask)
        lp = token_logprobs(response_logits_and_hidden(tuned, *args)[0], resp, temperature)
        ref = token_logprobs(response_logits_and_hidden(reference, *args)[0], resp, temperature)
        seq_kl.append(((lp - ref) * mask).sum(1))
        tokens += mask.sum().item()
    total = torch.cat(seq_kl)
    return total.mean().item(), total.sum().item() / max(tokens, 1.0)


def run(ctx: StageContext) -> dict:
    cfg, e = ctx.cfg, ctx.cfg.evaluate
    prompts = split(cfg.data, "eval")[: e.n_prompts]
    tokenizer, reference = load_policy(cfg.policy)
    tuned = load_causal_lm(model_dir(ctx, "ppo", "policy")).eval()

    seed = cfg.seed * 7919 + 17
    tuned_out = answer(tuned, tokenizer, cfg, prompts, seed)
    ref_out = answer(reference, tokenizer, cfg, prompts, seed)
    tuned_text = [t for batch in tuned_out for t in batch[3]]
    ref_text = [t for batch in ref_out for t in batch[3]]
    tuned_len = torch.cat([b[2].sum(1) for b in tuned_out]).float()
    ref_len = torch.cat([b[2].sum(1) for b in ref_out]).float()

    judge = make_judge(cfg)
    principles = load_constitution(cfg.label.constitution)
    chosen = [sample_principle(principles, cfg.seed + 1, p["id"])["text"] for p in prompts]
    p_tuned, _, _, consistent = debiased(judge, [p["prompt"] for p in prompts], tuned_text, ref_text, chosen)
    wins = int((p_tuned > 0.5 + e.tie_margin).sum())
    losses = int((p_tuned < 0.5 - e.tie_margin).sum())
    ties = len(prompts) - wins - losses
    win_rate = (wins + 0.5 * ties) / len(prompts)

    rm_path = model_dir(ctx, "train_rm", "model")
    rm_tokenizer, rm = load_reward_model(rm_path)
    stats = json.loads((rm_path / "reward_stats.json").read_text())
    norm = lambda r: (r - stats["mean"]) / max(stats["std"], 1e-6)  # noqa: E731
    r_tuned = norm(batched_rewards(rm, rm_tokenizer, [p["prompt"] for p in prompts], tuned_text, stats["max_length"], "cpu"))
    r_ref = norm(batched_rewards(rm, rm_tokenizer, [p["prompt"] for p in prompts], ref_text, stats["max_length"], "cpu"))
    kl_seq, kl_token = kl_to_reference(tuned, reference, tuned_out, e.temperature)

    metrics = {
        "n_prompts": len(prompts),
        "win_rate": win_rate,
        "win_rate_ci95": list(wilson_interval(wins + 0.5 * ties, len(prompts))),
        "wins": wins, "ties": ties, "losses": losses,
        "judge": judge.name,
        "judge_position_consistency": consistent.float().mean().item(),
        "reward_policy_mean": r_tuned.mean().item(), "reward_reference_mean": r_ref.mean().item(),
        "reward_policy_std": r_tuned.std().item(), "reward_reference_std": r_ref.std().item(),
        "kl_to_reference": kl_seq, "kl_to_reference_per_token": kl_token,
        "length_policy_mean": tuned_len.mean().item(), "length_reference_mean": ref_len.mean().item(),
    }
    examples = [{"id": p["id"], "prompt": p["prompt"], "tuned": t, "reference": r, "p_tuned_better": pt.item()}
                for p, t, r, pt in zip(prompts, tuned_text, ref_text, p_tuned)]
    files = [ctx.write_json("metrics.json", metrics)]
    data = "".join(json.dumps(x) + "\n" for x in examples).encode()
    storage.write_bytes_atomic(storage.join(ctx.url, "examples.jsonl"), data)
    md = render_markdown(cfg, metrics, examples[: e.n_examples])
    storage.write_bytes_atomic(storage.join(ctx.url, "report.md"), md.encode())
    plot_url = storage.join(ctx.input_url("ppo"), "reward_kl.png")
    plot = storage.read_bytes(plot_url) if storage.exists(plot_url) else None
    storage.write_bytes_atomic(storage.join(ctx.url, "report.html"), render_html(cfg, metrics, examples[: e.n_examples], plot).encode())
    lo, hi = metrics["win_rate_ci95"]
    print(f"evaluate: win rate {win_rate:.3f} [{lo:.3f}, {hi:.3f}] over {len(prompts)} held-out prompts, "
          f"reward {metrics['reward_policy_mean']:.2f} vs {metrics['reward_reference_mean']:.2f}, KL {kl_seq:.3f}")
    return ctx.commit(files=files, num_samples=len(prompts), summary=metrics)


def _rows(metrics: dict) -> list[tuple[str, str]]:
    lo, hi = metrics["win_rate_ci95"]
    return [
        ("win rate (tuned vs start)", f"{metrics['win_rate']:.3f}  [95% CI {lo:.3f}, {hi:.3f}]"),
        ("wins / ties / losses", f"{metrics['wins']} / {metrics['ties']} / {metrics['losses']}  of {metrics['n_prompts']}"),
        ("reward (normalised), tuned vs start", f"{metrics['reward_policy_mean']:.3f} vs {metrics['reward_reference_mean']:.3f}"),
        ("KL to reference (per sequence / per token)", f"{metrics['kl_to_reference']:.3f} / {metrics['kl_to_reference_per_token']:.4f}"),
        ("response length (tokens), tuned vs start", f"{metrics['length_policy_mean']:.1f} vs {metrics['length_reference_mean']:.1f}"),
        ("judge", f"{metrics['judge']} (position consistency {metrics['judge_position_consistency']:.2f})"),
    ]


def render_markdown(cfg, metrics: dict, examples: list[dict]) -> str:
    lines = [f"# rlaif report: run `{cfg.run_id}`", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _rows(metrics)]
    lines += ["", "## Examples", ""]
    for x in examples:
        lines += [f"**Prompt:** {x['prompt']}", "", f"- tuned: {x['tuned']}", f"- start: {x['reference']}",
                  f"- P(tuned better) = {x['p_tuned_better']:.2f}", ""]
    return "\n".join(lines)


def render_html(cfg, metrics: dict, examples: list[dict], plot_png: bytes | None) -> str:
    esc = html.escape
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _rows(metrics))
    img = f'<img alt="PPO reward and KL" src="data:image/png;base64,{base64.b64encode(plot_png).decode()}">' if plot_png else ""
    ex = "".join(
        f"<tr><td>{esc(x['prompt'])}</td><td>{esc(x['tuned'])}</td><td>{esc(x['reference'])}</td><td>{x['p_tuned_better']:.2f}</td></tr>"
        for x in examples
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rlaif report: {esc(cfg.run_id)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}}table{{border-collapse:collapse;width:100%;margin:1em 0}}
th,td{{border:1px solid #ddd;padding:6px 8px;text-align:left;vertical-align:top}}th{{background:#f5f5f5}}img{{max-width:100%}}</style></head>
<body><h1>rlaif report: run <code>{esc(cfg.run_id)}</code></h1><table>{table}</table>{img}
<h2>Examples</h2><table><tr><th>prompt</th><th>tuned</th><th>start</th><th>P(tuned better)</th></tr>{ex}</table></body></html>"""
