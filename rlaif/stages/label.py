"""Stage 2: an AI judge labels each response pair with a soft preference, position bias removed.

Pairwise mode scores both orders: p_a = 0.5 * (P(first=a) + 1 - P(first=b)). Score mode (d-RLAIF) scores each
response alone in [-1, 1]. One constitution principle is sampled per pair from a seed and the pair's key, so labels do
not depend on sharding or order. Pairs within label.min_confidence of 0.5 are dropped and counted.
"""
from __future__ import annotations

import random

import yaml
from tqdm import tqdm

from rlaif.config import sha256_json
from rlaif.errors import UserError
from rlaif.io.shards import ShardWriter, read_samples
from rlaif.judges import debiased, make_judge, scored
from rlaif.stages.common import StageContext

REQUIRED = ("prompt.txt", "response_a.txt", "response_b.txt")
HISTOGRAM_BINS = 10


def load_constitution(path: str) -> list[dict]:
    try:
        principles = yaml.safe_load(open(path, encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"constitution file not found: {path} (set label.constitution)") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"constitution {path} is not valid UTF-8 YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(principles, list) or not principles or not all(isinstance(p, dict) and "text" in p for p in principles):
        raise UserError(f"constitution {path} must be a YAML list of {{name, text}} principles")
    return principles


def sample_principle(principles: list[dict], seed: int, key: str) -> dict:
    return principles[random.Random(sha256_json([seed, key])).randrange(len(principles))]


def label_batch(cfg, judge, principles: list[dict], batch: list[dict]) -> list[dict]:
    """One label.json per pair: p(a preferred), each order's value or each response's score, the principle, the judge."""
    chosen = [sample_principle(principles, cfg.seed, s["__key__"]) for s in batch]
    args = ([s["prompt.txt"] for s in batch], [s["response_a.txt"] for s in batch], [s["response_b.txt"] for s in batch],
            [c["text"] for c in chosen])
    common = [{"judge": judge.name, "principle": c.get("name", c["text"]), "mode": cfg.label.mode} for c in chosen]
    if cfg.label.mode == "score":
        p, s_a, s_b = scored(judge, *args, cfg.label.temperature)
        return [{**c, "p_a": p[k].item(), "score_a": s_a[k].item(), "score_b": s_b[k].item()} for k, c in enumerate(common)]
    p, p_ab, p_ba, agree = debiased(judge, *args)
    return [{**c, "p_a": p[k].item(), "p_a_order_ab": p_ab[k].item(), "p_a_order_ba": p_ba[k].item(),
             "position_consistent": bool(agree[k])} for k, c in enumerate(common)]


def run(ctx: StageContext) -> dict:
    cfg, lc = ctx.cfg, ctx.cfg.label
    principles = load_constitution(lc.constitution)
    judge = make_judge(lc, lc.batch_size)
    pairs_url, pairs = ctx.input_url("generate"), ctx.inputs["generate"]

    histogram = [0] * HISTOGRAM_BINS
    n_seen, n_kept, n_consistent, p_sum = 0, 0, 0, 0.0
    with ShardWriter(ctx.url, lc.shard_size) as writer:
        batch: list[dict] = []

        def flush():
            nonlocal n_seen, n_kept, n_consistent, p_sum
            for sample, label in zip(batch, label_batch(cfg, judge, principles, batch)):
                n_seen += 1
                histogram[min(int(label["p_a"] * HISTOGRAM_BINS), HISTOGRAM_BINS - 1)] += 1
                n_consistent += label.get("position_consistent", True)
                p_sum += label["p_a"]
                if abs(label["p_a"] - 0.5) < lc.min_confidence:
                    continue
                writer.write({**{f: sample[f] for f in ("__key__", *REQUIRED, "gen.json") if f in sample}, "label.json": label})
                n_kept += 1
            batch.clear()

        for sample in tqdm(read_samples(pairs_url, pairs, 0, 1, 0, 1), total=pairs["num_samples"], desc="label", unit="pair"):
            missing = [f for f in REQUIRED if f not in sample]
            if missing:
                raise UserError(f"pair {sample['__key__']} in {pairs_url} lacks {', '.join(missing)}: re-run stage 'generate'")
            batch.append(sample)
            if len(batch) == lc.batch_size:
                flush()
        if batch:
            flush()
    if n_kept == 0:
        raise UserError(f"label: all {n_seen} pairs were dropped as low-confidence: lower label.min_confidence "
                        f"(now {lc.min_confidence})")
    summary = {"pairs": n_kept, "pairs_judged": n_seen, "dropped_low_confidence": n_seen - n_kept,
               "position_consistency": n_consistent / max(n_seen, 1) if lc.mode == "pairwise" else None,
               "mean_p_a": p_sum / max(n_seen, 1), "p_a_histogram": histogram, "judge": judge.name, "mode": lc.mode,
               **({"endpoint": dict(judge.stats)} if hasattr(judge, "stats") else {})}
    consistency = f"position consistency {summary['position_consistency']:.3f}, " if lc.mode == "pairwise" else ""
    print(f"label: {n_seen} pairs judged by {judge.name}, {consistency}{n_seen - n_kept} dropped as low-confidence, "
          f"p(a) histogram {histogram}")
    return ctx.commit(shards=writer.shards, summary=summary)
