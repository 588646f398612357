"""Stage 1: sample two responses per training prompt from the starting policy.

Reads the prompts file (training split), writes WebDataset shards of {prompt.txt, response_a.txt, response_b.txt,
gen.json}. Each micro-batch is seeded from (seed, batch index), so the stage is reproducible.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from rlaif.distributed import local_device
from rlaif.io.prompts import split
from rlaif.io.shards import ShardWriter
from rlaif.models.generation import decode, encode_prompts, response_mask, sample
from rlaif.models.loading import load_policy
from rlaif.stages.common import StageContext


def run(ctx: StageContext) -> dict:
    cfg, g = ctx.cfg, ctx.cfg.generate
    prompts = split(cfg.data, "train")[: g.max_prompts]
    tokenizer, model = load_policy(cfg.policy)
    device = local_device()
    model.to(device)

    start, n_tokens, identical = time.time(), 0, 0
    with ShardWriter(ctx.url, g.shard_size) as writer:
        batches = range(0, len(prompts), g.batch_size)
        for b, i in enumerate(tqdm(batches, desc="generate", unit="batch")):
            rows = prompts[i : i + g.batch_size]
            enc = encode_prompts(tokenizer, [cfg.policy.prompt_template.format(prompt=r["prompt"]) for r in rows], device)
            responses = sample(model, tokenizer, enc, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                               top_p=g.top_p, top_k=g.top_k, num_return_sequences=2, seed=cfg.seed * 1_000_003 + b)
            mask = response_mask(responses, tokenizer.eos_token_id)
            n_tokens += int(mask.sum())
            responses, mask = responses.cpu(), mask.cpu()
            texts = decode(tokenizer, responses, mask)
            lengths = mask.sum(1).tolist()
            for j, row in enumerate(rows):
                a, bb = texts[2 * j], texts[2 * j + 1]
                identical += a == bb
                writer.write({
                    "__key__": row["id"],
                    "prompt.txt": row["prompt"],
                    "response_a.txt": a,
                    "response_b.txt": bb,
                    "gen.json": {"policy": cfg.policy.model, "batch": b, "tokens_a": lengths[2 * j], "tokens_b": lengths[2 * j + 1]},
                })
    seconds = time.time() - start
    summary = {"prompts": len(prompts), "identical_pairs": identical, "tokens": n_tokens, "tokens_per_s": n_tokens / max(seconds, 1e-9)}
    print(f"generate: {len(prompts)} pairs, {n_tokens} tokens in {seconds:.1f}s ({summary['tokens_per_s']:.0f} tok/s), "
          f"{identical} identical pairs")
    return ctx.commit(shards=writer.shards, summary=summary)
