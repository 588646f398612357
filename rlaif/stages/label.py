"""Stage 2: an AI judge labels each response pair with a soft preference, position bias removed.

Pairwise mode scores both orders: p_a = 0.5 * (P(first=a) + 1 - P(first=b)). Score mode (d-RLAIF) scores each
response alone in [-1, 1]. Principles are sampled one per pair from a seed and the pair's key (so labels do not depend
on sharding or order) or all applied and averaged (`label.principles`). Pairs within label.min_confidence of 0.5 are
dropped and counted. Where the prompts carry references, the reference judge grades every pair too, and metrics.json
reports how often the AI labeler agrees with it where it has a clear preference (the RLAIF paper's "AI labeler
alignment", with a verifiable grader in place of human raters).

With label.streaming, and generate's output not committed yet, the pairs are read as generate's shards land, in the
order its manifest will list them (rlaif.io.stream): the same batches, labels and output shards as reading the
committed output, and once generate commits, the same cache key and manifest digest.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from rlaif.errors import UserError
from rlaif.io import stream
from rlaif.io.prompts import load_prompts
from rlaif.io.shards import ShardWriter, iter_shard
from rlaif.judges import make_judge
from rlaif.judges.constitution import compare, judge_principles, score_each
from rlaif.judges.reference import CLEAR_MARGIN, reference_points
from rlaif.judges.reference import grader as reference_grader
from rlaif.progress import progress
from rlaif.stages.common import StageContext, cleared_when_streaming_starts, resolved, upstream_follower

REQUIRED = ("prompt.txt", "response_a.txt", "response_b.txt")
HISTOGRAM_BINS = 10


def label_batch(cfg, judge, principles: list[dict], batch: list[dict]) -> list[dict]:
    """One label.json per pair: p(a preferred), each order's value or each response's score, the principle,
    the judge."""
    lc, keys = cfg.label, [s["__key__"] for s in batch]
    prompts, first, second = ([s[f] for s in batch] for f in REQUIRED)
    if lc.mode == "score":
        s_a, s_b = (score_each(judge, principles, lc.principles, cfg.seed, keys, prompts, r) for r in (first, second))
        p = torch.sigmoid((s_a - s_b) / lc.temperature)
        names = ["all" if lc.principles == "all" else "sampled"] * len(batch)
        return [{"judge": judge.name, "principle": names[k], "mode": "score", "p_a": p[k].item(),
                 "score_a": s_a[k].item(), "score_b": s_b[k].item()} for k in range(len(batch))]
    p, p_ab, p_ba, agree, names = compare(judge, principles, lc.principles, cfg.seed, keys, prompts, first, second)
    return [{"judge": judge.name, "principle": names[k], "mode": "pairwise", "p_a": p[k].item(),
             "p_a_order_ab": p_ab[k].item(), "p_a_order_ba": p_ba[k].item(), "position_consistent": bool(agree[k])}
            for k in range(len(batch))]


class Tally:
    """The stage's counts: kept and dropped pairs, the label histogram, position consistency, reference agreement."""

    def __init__(self):
        self.histogram = [0] * HISTOGRAM_BINS
        self.seen = self.kept = self.consistent = self.kept_ties = 0
        self.p_sum = 0.0
        self.reference_clear = self.reference_agree = self.reference_graded = 0

    def add(self, label: dict, kept: bool, p_reference: float | None) -> None:
        self.seen += 1
        self.kept += kept
        self.kept_ties += kept and label["p_a"] == 0.5
        self.histogram[min(int(label["p_a"] * HISTOGRAM_BINS), HISTOGRAM_BINS - 1)] += 1
        self.consistent += label.get("position_consistent", True)
        self.p_sum += label["p_a"]
        if p_reference is not None:
            self.reference_graded += 1
            if abs(p_reference - 0.5) >= CLEAR_MARGIN:
                self.reference_clear += 1
                # a labeler without a preference (0.5) does not agree with a clear reference
                self.reference_agree += label["p_a"] != 0.5 and (label["p_a"] > 0.5) == (p_reference > 0.5)

    def metrics(self) -> dict:
        graded = self.reference_graded > 0
        return {"pairs_judged": self.seen, "pairs": self.kept, "dropped_low_confidence": self.seen - self.kept,
                "mean_p_a": self.p_sum / max(self.seen, 1), "p_a_histogram": self.histogram,
                "reference_agreement": self.reference_agree / self.reference_clear if self.reference_clear else None,
                "reference_clear_pairs": self.reference_clear if graded else None,
                "reference_graded_pairs": self.reference_graded}


def pair_shards(ctx: StageContext, pairs_url: str) -> tuple[Iterable[dict], int | None, stream.Follower | None]:
    """generate's shards in its manifest's order and their pair count where known: from the committed manifest, or,
    streaming, as they land (the follower holds the manifest once generate has committed)."""
    if "generate" not in ctx.streamed:
        return ctx.inputs["generate"]["shards"], ctx.inputs["generate"]["num_samples"], None
    follower = upstream_follower(ctx)
    print(f"label: streaming generate's shards from {pairs_url} as they land", flush=True)
    return cleared_when_streaming_starts(ctx, follower.shards()), None, follower


def check_informative(tally: Tally, judge: str, min_confidence: float) -> None:
    """Labels a reward model can learn from: some kept, not every one a tie."""
    if tally.kept == 0:
        raise UserError(f"label: all {tally.seen} pairs were dropped as low-confidence: lower label.min_confidence "
                        f"(now {min_confidence})")
    if tally.kept_ties == tally.kept:
        raise UserError(f"label: judge '{judge}' preferred neither response in every one of the {tally.kept} "
                        "kept pairs (all labels 0.5), so the reward model has nothing to learn: check the judge's "
                        "settings (label.*; a rules judge needs checks the responses differ on) and its answers")


def run(ctx: StageContext) -> dict:
    cfg, settings = ctx.cfg, ctx.cfg.label
    principles = judge_principles(settings)
    prompts = load_prompts(cfg.data)
    judge = make_judge(settings, settings.batch_size, reference_points(prompts))
    grader = reference_grader(prompts, settings.reference)
    pairs_url = ctx.input_url("generate")
    shards, total, follower = pair_shards(ctx, pairs_url)

    if settings.principles == "all" and len(principles) > 1:  # the work is pairs x principles: say so up front
        print(f"label: {total if total is not None else 'the'} pairs, each judged under all {len(principles)} "
              "principles", flush=True)
    tally = Tally()
    bar = progress(total=total, desc="label", unit="pair")  # pairs judged, not pairs read into a batch
    with ShardWriter(ctx.url, settings.shard_size) as writer:
        batch: list[dict] = []

        def flush():
            labels = label_batch(cfg, judge, principles, batch)
            p_reference = grader.prefer_first_where_graded(*([s[f] for s in batch] for f in REQUIRED)) if grader else {}
            for k, (sample, label) in enumerate(zip(batch, labels)):
                if not math.isfinite(label["p_a"]):  # never written as a label, nor counted
                    raise UserError(f"judge '{judge.name}' gave pair {sample['__key__']} a label that is not a number "
                                    f"({label['p_a']}): check its settings (label.*) and its answers")
                kept = abs(label["p_a"] - 0.5) >= settings.min_confidence
                tally.add(label, kept, p_reference.get(k))
                if kept:
                    writer.write({**{f: sample[f] for f in ("__key__", *REQUIRED, "gen.json") if f in sample},
                                  "label.json": label})
            bar.update(len(batch))
            batch.clear()

        for sample in (sample for shard in shards for sample in iter_shard(pairs_url, shard)):
            missing = [f for f in REQUIRED if f not in sample]
            if missing:
                raise UserError(f"pair {sample['__key__']} in {pairs_url} lacks {', '.join(missing)}: "
                                "re-run stage 'generate'")
            batch.append(sample)
            if len(batch) == settings.batch_size:
                flush()
        if batch:
            flush()
    bar.close()
    check_informative(tally, judge.name, settings.min_confidence)
    if follower:  # generate has committed: the cache key a sequential run computes
        ctx = resolved(ctx, {"generate": follower.manifest})
    summary = {**tally.metrics(), "judge": judge.name, "mode": settings.mode, "principles": settings.principles,
               "position_consistency": tally.consistent / max(tally.seen, 1) if settings.mode == "pairwise" else None,
               **({"endpoint": dict(judge.stats)} if hasattr(judge, "stats") else {})}
    # metrics.json is part of the output's digest: the service's request and retry counts say how a run went, not
    # what it computed, so they stay in the manifest's summary
    files = [ctx.write_json("metrics.json", {k: v for k, v in summary.items() if k != "endpoint"})]
    log_summary(tally, summary)
    return ctx.commit(shards=writer.shards, files=files, summary=summary)


def log_summary(tally: Tally, summary: dict) -> None:
    consistency = ("" if summary["position_consistency"] is None
                   else f"position consistency {summary['position_consistency']:.3f}, ")
    agreement = ("" if summary["reference_agreement"] is None else
                 f"agreement with the reference judge {summary['reference_agreement']:.3f} "
                 f"({tally.reference_clear} clear pairs), ")
    unreadable = summary.get("endpoint", {}).get("answers_unreadable")
    unread = f"{unreadable} answers neither 1 nor 2 (labelled 0.5), " if unreadable else ""
    print(f"label: {tally.seen} pairs judged by {summary['judge']}, {consistency}{agreement}{unread}"
          f"{tally.seen - tally.kept} dropped as low-confidence, p(a) histogram {tally.histogram}")
