"""Stage 5: the tuned policy against the starting policy on held-out prompts.

Both policies answer each held-out prompt (same sampling settings and seeds). The judge compares the two answers in
both orders (position-debiased); a comparison within `tie_margin` of 0.5 is a tie and counts half. Also: reward-model
scores of both, KL of the tuned policy to the reference on its own samples, response lengths, and how varied the
answers are (mode collapse). Several judges are reported side by side, with a length-controlled win rate; where the
held-out prompts carry references, the `reference` judge (key-point coverage, no model) is added as ground truth.
Writes metrics.json and examples.jsonl (the manifest's files) and the report built from them (report.md,
report.html, plots/). Quality gates in config end the stage with
exit code 2 and no manifest, so an orchestrator marks the run failed and does not promote the model.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from rlaif import report
from rlaif.algo.stats import diversity, length_controlled_win_rate, sample_std, wilson_interval
from rlaif.config import JudgeSpec
from rlaif.distributed import local_device
from rlaif.errors import UserError
from rlaif.io import manifest, storage
from rlaif.io.prompts import split
from rlaif.judges import make_judge
from rlaif.judges.constitution import compare, judge_principles
from rlaif.judges.reference import reference_points
from rlaif.models.generation import decode, encode_prompts, is_stop, response_logprobs, response_mask, sample, stop_ids
from rlaif.models.loading import load_causal_lm, load_policy
from rlaif.models.prompt_text import format_prompts
from rlaif.models.reward import NormalisedScorer
from rlaif.stages.common import StageContext, model_dir, run_url, stage_url


@dataclass
class Answers:
    """One policy's answers to the held-out prompts: per batch (encoding, response ids, mask, text), and flat."""

    batches: list
    text: list[str]
    lengths: torch.Tensor
    eos_rate: float
    rewards: torch.Tensor | None = None


@torch.no_grad()
def answer(model, tokenizer, cfg, prompts, seed_base) -> Answers:
    """Responses batch by batch with fixed seeds."""
    settings = cfg.evaluate
    batches = []
    for b in range(0, len(prompts), settings.batch_size):
        rows = prompts[b : b + settings.batch_size]
        texts = format_prompts(tokenizer, cfg.policy, [p["prompt"] for p in rows])
        enc = encode_prompts(tokenizer, texts, model.device)
        resp = sample(model, tokenizer, enc, max_new_tokens=settings.max_new_tokens,
                      temperature=settings.temperature, seed=seed_base + b)
        mask = response_mask(resp, stop_ids(tokenizer))
        batches.append((enc, resp, mask, decode(tokenizer, resp, mask)))
    # Share of answers that ended with EOS rather than running into max_new_tokens.
    ended = torch.cat([is_stop(resp, stop_ids(tokenizer)).any(1) for _, resp, _, _ in batches])
    return Answers(batches, [t for batch in batches for t in batch[3]],
                   torch.cat([b[2].sum(1) for b in batches]).float().cpu(), ended.float().mean().item())


@torch.no_grad()
def kl_to_reference(tuned, reference, batches, temperature) -> tuple[float, float]:
    """Mean per-sequence and per-token KL(tuned || reference), estimated on the tuned policy's own samples (k1)."""
    seq_kl, tokens = [], 0.0
    for enc, resp, mask, _ in batches:
        args = (enc["input_ids"], enc["attention_mask"], resp, mask)
        lp = response_logprobs(tuned, *args, temperature)[0]
        ref = response_logprobs(reference, *args, temperature)[0]
        seq_kl.append(((lp - ref) * mask).sum(1))
        tokens += mask.sum().item()
    total = torch.cat(seq_kl)
    return total.mean().item(), total.sum().item() / max(tokens, 1.0)


def judge_specs(cfg, references: dict) -> list[JudgeSpec]:
    """The training judge (label's), the configured ones, and the reference judge where every prompt has references."""
    training = JudgeSpec(name="training", **cfg.label.model_dump(include=set(JudgeSpec.model_fields) - {"name"}))
    specs = [training, *cfg.evaluate.judges]
    if references and not any(s.judge == "reference" for s in specs):
        specs.append(JudgeSpec(name="reference", judge="reference", reference=cfg.label.reference))
    return specs


def judge_all(cfg, prompts, tuned: Answers, start: Answers) -> tuple[dict, dict]:
    """Every judge compares tuned vs start on every prompt, both orders; returns (per-judge metrics, per-judge
    P(tuned better) lists)."""
    settings = cfg.evaluate
    references = reference_points(prompts)
    references = references if len(references) == len({p["prompt"] for p in prompts}) else {}
    results, p_by_judge = {}, {}
    for spec in judge_specs(cfg, references):
        judge = make_judge(spec, cfg.label.batch_size, references)
        principles = judge_principles(spec)
        p_tuned, _, _, consistent, _ = compare(judge, principles, spec.principles, cfg.seed + 1,
                                               [p["id"] for p in prompts], [p["prompt"] for p in prompts],
                                               tuned.text, start.text)
        margin = settings.tie_margin
        outcome = torch.where(p_tuned > 0.5 + margin, 1.0, torch.where(p_tuned < 0.5 - margin, 0.0, 0.5))
        wins, losses = int((outcome == 1).sum()), int((outcome == 0).sum())
        ties = len(prompts) - wins - losses
        results[spec.name] = {
            "judge": judge.name, "win_rate": outcome.mean().item(),
            "win_rate_ci95": list(wilson_interval(outcome.sum().item(), len(prompts))),
            "win_rate_length_controlled": length_controlled_win_rate(outcome.tolist(), tuned.lengths.tolist(),
                                                                     start.lengths.tolist()),
            "wins": wins, "ties": ties, "losses": losses,
            "position_consistency": consistent.float().mean().item(),
        }
        p_by_judge[spec.name] = p_tuned.tolist()
    return results, p_by_judge


def check_gates(settings, metrics: dict) -> dict:
    failures = []
    if settings.min_win_rate is not None and metrics["win_rate"] < settings.min_win_rate:
        failures.append(f"win rate {metrics['win_rate']:.3f} < evaluate.min_win_rate {settings.min_win_rate}")
    if settings.max_kl is not None and metrics["kl_to_reference"] > settings.max_kl:
        failures.append(f"KL to reference {metrics['kl_to_reference']:.3f} > evaluate.max_kl {settings.max_kl}")
    return {"checked": settings.min_win_rate is not None or settings.max_kl is not None, "passed": not failures,
            "failures": failures, "min_win_rate": settings.min_win_rate, "max_kl": settings.max_kl}


def run(ctx: StageContext) -> dict:
    cfg, settings = ctx.cfg, ctx.cfg.evaluate
    prompts = split(cfg.data, "eval")[: settings.n_prompts]
    device = local_device()
    tokenizer, reference = load_policy(cfg.policy)
    reference.to(device)
    tuned_model = load_causal_lm(model_dir(ctx, "ppo", "policy"), what="tuned policy").eval().to(device)

    seed = cfg.seed * 7919 + 17
    tuned, start = (answer(model, tokenizer, cfg, prompts, seed) for model in (tuned_model, reference))
    judges, p_by_judge = judge_all(cfg, prompts, tuned, start)
    score = NormalisedScorer(model_dir(ctx, "train_rm", "model"), device)
    tuned.rewards, start.rewards = (score([p["prompt"] for p in prompts], a.text) for a in (tuned, start))
    kl = kl_to_reference(tuned_model, reference, tuned.batches, settings.temperature)

    metrics = summarize(ctx, len(prompts), judges, tuned, start, kl)
    files = [ctx.write_json("metrics.json", metrics), write_examples(ctx, prompts, tuned, start, p_by_judge)]
    # a view of the files above (`rlaif report`); this stage's manifest comes after it, so it passes its time
    report_url = report.write(run_url(cfg), settings.n_examples, evaluate_seconds=ctx.elapsed())
    log_summary(metrics)
    if not metrics["gates"]["passed"]:
        raise UserError(f"quality gate failed: {'; '.join(metrics['gates']['failures'])} (report: {report_url}); the "
                        "model is not promoted")
    return ctx.commit(files=files, num_samples=len(prompts), summary=metrics)


def summarize(ctx: StageContext, n_prompts: int, judges: dict, tuned: Answers, start: Answers,
              kl: tuple[float, float]) -> dict:
    """metrics.json: the training judge's verdict first, every judge, rewards, KL, lengths, diversity, upstream
    numbers (the labels and the reward model behind this policy) and the quality gates."""
    primary = judges["training"]
    metrics = {
        "n_prompts": n_prompts,
        **{key: primary[key]
           for key in ("win_rate", "win_rate_ci95", "win_rate_length_controlled", "wins", "ties", "losses")},
        "judge": primary["judge"], "judge_position_consistency": primary["position_consistency"],
        "judges": judges,
        "reward_policy_mean": tuned.rewards.mean().item(), "reward_reference_mean": start.rewards.mean().item(),
        "reward_policy_std": sample_std(tuned.rewards), "reward_reference_std": sample_std(start.rewards),
        "kl_to_reference": kl[0], "kl_to_reference_per_token": kl[1],
        "length_policy_mean": tuned.lengths.mean().item(), "length_reference_mean": start.lengths.mean().item(),
        "eos_rate_policy": tuned.eos_rate, "eos_rate_reference": start.eos_rate,
        "diversity": diversity(tuned.text), "diversity_reference": diversity(start.text),
    }
    label = manifest.read(stage_url(ctx.cfg, "label")) or {"summary": {}}
    reward_model = ctx.inputs["train_rm"]["summary"]
    metrics["upstream"] = {"label_reference_agreement": label["summary"].get("reference_agreement"),
                           "rm_held_out_accuracy": reward_model.get("held_out_accuracy"),
                           "rm_held_out_reference_accuracy": reward_model.get("held_out_reference_accuracy")}
    metrics["gates"] = check_gates(ctx.cfg.evaluate, metrics)
    return metrics


def write_examples(ctx: StageContext, prompts: list[dict], tuned: Answers, start: Answers, p_by_judge: dict) -> dict:
    """examples.jsonl: every held-out prompt with both answers, their rewards and lengths, and each judge's verdict."""
    columns = zip(prompts, tuned.text, start.text, tuned.rewards.tolist(), start.rewards.tolist(),
                  tuned.lengths.tolist(), start.lengths.tolist())
    examples = [{"id": p["id"], "prompt": p["prompt"], "tuned": t, "reference": r,
                 "reward_tuned": rt, "reward_reference": rr, "length_tuned": lt, "length_reference": lr,
                 "p_tuned_better": {name: ps[i] for name, ps in p_by_judge.items()}}
                for i, (p, t, r, rt, rr, lt, lr) in enumerate(columns)]
    data = "".join(manifest.json_line(x) + "\n" for x in examples).encode()
    storage.write_bytes_atomic(storage.join(ctx.url, "examples.jsonl"), data)
    return {"path": "examples.jsonl", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def log_summary(metrics: dict) -> None:
    lo, hi = metrics["win_rate_ci95"]
    print(f"evaluate: win rate {metrics['win_rate']:.3f} [{lo:.3f}, {hi:.3f}] (length-controlled "
          f"{metrics['win_rate_length_controlled']:.3f}) over {metrics['n_prompts']} held-out prompts, "
          f"reward {metrics['reward_policy_mean']:.2f} vs {metrics['reward_reference_mean']:.2f}, "
          f"KL {metrics['kl_to_reference']:.3f}")
    for name, judge in metrics["judges"].items():
        if name != "training":
            lo, hi = judge["win_rate_ci95"]
            print(f"evaluate: judge '{name}': win rate {judge['win_rate']:.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"evaluate: most common tuned answer {metrics['diversity']['top_response_share']:.3f} of all, distinct-2 "
          f"{metrics['diversity']['distinct_2']:.3f}")
    for line in report.verdicts(metrics):
        print(f"evaluate: {line}")
