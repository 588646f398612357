"""Stage 2: an AI judge labels each response pair with a soft preference, position bias removed.

Both orders are scored: p_a = 0.5 * (P(first=a) + 1 - P(first=b)). One constitution principle is sampled per pair
from a seed and the pair's key, so labels do not depend on sharding or order.
"""
from __future__ import annotations

import random

import yaml
from tqdm import tqdm

from rlaif.config import sha256_json
from rlaif.errors import UserError
from rlaif.io.shards import ShardWriter, read_samples
from rlaif.judges.embedding import EmbeddingJudge
from rlaif.stages.common import StageContext


def load_constitution(path: str) -> list[dict]:
    try:
        principles = yaml.safe_load(open(path, encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"constitution file not found: {path} (set label.constitution)") from None
    if not isinstance(principles, list) or not principles or not all(isinstance(p, dict) and "text" in p for p in principles):
        raise UserError(f"constitution {path} must be a YAML list of {{name, text}} principles")
    return principles


def sample_principle(principles: list[dict], seed: int, key: str) -> dict:
    return principles[random.Random(sha256_json([seed, key])).randrange(len(principles))]


def make_judge(kind: str, temperature: float, relevance_weight: float, batch_size: int):
    if kind == "embedding":
        return EmbeddingJudge(temperature, relevance_weight, batch_size)
    raise UserError(f"unknown judge {kind!r}: use 'embedding'")


def debiased(judge, prompts, first, second, principle_texts):
    """P(first better) from both orders, and whether the two orders agree."""
    p_order_ab = judge.prefer_first(prompts, first, second, principle_texts)
    p_order_ba = 1.0 - judge.prefer_first(prompts, second, first, principle_texts)
    p = 0.5 * (p_order_ab + p_order_ba)
    consistent = (p_order_ab > 0.5) == (p_order_ba > 0.5)
    return p, p_order_ab, p_order_ba, consistent


REQUIRED = ("prompt.txt", "response_a.txt", "response_b.txt")


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    principles = load_constitution(cfg.label.constitution)
    judge = make_judge(cfg.label.judge, cfg.label.temperature, cfg.label.relevance_weight, cfg.label.batch_size)
    pairs_url, pairs = ctx.input_url("generate"), ctx.inputs["generate"]

    n, consistent_count, p_sum, confident = 0, 0, 0.0, 0
    with ShardWriter(ctx.url, cfg.label.shard_size) as writer:
        batch: list[dict] = []

        def flush():
            nonlocal n, consistent_count, p_sum, confident
            chosen = [sample_principle(principles, cfg.seed, s["__key__"]) for s in batch]
            p, p_ab, p_ba, agree = debiased(judge, [s["prompt.txt"] for s in batch], [s["response_a.txt"] for s in batch],
                                            [s["response_b.txt"] for s in batch], [c["text"] for c in chosen])
            for k, s in enumerate(batch):
                label = {"p_a": p[k].item(), "p_a_order_ab": p_ab[k].item(), "p_a_order_ba": p_ba[k].item(),
                         "judge": judge.name, "principle": chosen[k].get("name", chosen[k]["text"]),
                         "position_consistent": bool(agree[k])}
                writer.write({**{f: s[f] for f in ("__key__", *REQUIRED, "gen.json") if f in s}, "label.json": label})
                n += 1
                consistent_count += bool(agree[k])
                p_sum += label["p_a"]
                confident += abs(label["p_a"] - 0.5) >= 0.25
            batch.clear()

        for sample in tqdm(read_samples(pairs_url, pairs, 0, 1, 0, 1), total=pairs["num_samples"], desc="label", unit="pair"):
            missing = [f for f in REQUIRED if f not in sample]
            if missing:
                raise UserError(f"pair {sample['__key__']} in {pairs_url} lacks {', '.join(missing)}: re-run stage 'generate'")
            batch.append(sample)
            if len(batch) == cfg.label.batch_size:
                flush()
        if batch:
            flush()
    summary = {"pairs": n, "position_consistency": consistent_count / max(n, 1), "mean_p_a": p_sum / max(n, 1),
               "confident_fraction": confident / max(n, 1), "judge": judge.name}
    print(f"label: {n} pairs, position consistency {summary['position_consistency']:.3f}, "
          f"{summary['confident_fraction']:.1%} confident (|p-0.5|>=0.25)")
    return ctx.commit(shards=writer.shards, summary=summary)
