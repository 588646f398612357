"""Stage 1: sample response pairs for the training prompts from the starting policy.

Writes WebDataset shards of {prompt.txt, response_a.txt, response_b.txt, gen.json}. Every sample has its own seed,
derived from (seed, prompt id, sample index), so any pair can be regenerated exactly and the output does not depend on
batching, length bucketing or how the prompts are split. The prompts can be split into disjoint parts: the ranks of
a torchrun launch, or separate pods given `--shard-index I --num-shards N`; each part writes its shards and a part
file, and the last part to finish (rank 0 under torchrun) merges them into one manifest. Every part also records each
shard as it lands, then its end or its failure (rlaif.io.stream), so label can stream the pairs before the manifest.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

from rlaif import distributed, faults
from rlaif.config import sha256_json
from rlaif.errors import UserError
from rlaif.io import manifest, storage, stream
from rlaif.io.prompts import split
from rlaif.io.shards import ShardWriter
from rlaif.models.generation import sample_texts
from rlaif.models.loading import load_policy, resolve_policy
from rlaif.models.prompt_text import check_fits, format_prompts, prompt_token_ids
from rlaif.progress import progress
from rlaif.stages.common import StageContext

PART_SHARD_STRIDE = 100_000  # part i numbers its shards from i * stride, so names never collide and sort by part


def sample_seed(seed: int, prompt_id: str, index: int) -> int:
    return int(sha256_json([seed, prompt_id, index])[:15], 16)


def part_of(ctx: StageContext) -> tuple[int, int]:
    """(index, count) of this process's part: --shard-index/--num-shards, else the torchrun rank and world size."""
    if ctx.num_parts > 1:
        return ctx.part_index, ctx.num_parts
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def part_url(ctx: StageContext, index: int, count: int) -> str:
    return storage.join(ctx.url, "parts", f"part-{index:05d}-of-{count:05d}.json")


def read_part(ctx: StageContext, index: int, count: int, merging: bool = False) -> dict | None:
    """A finished part's record (its shards and counts) if it was made with this config, else None. Merging, a part
    left by other settings is named: it is re-made when that part runs with these (parts may start at other times),
    and until then the manifest waits for it."""
    try:
        part = json.loads(storage.read_bytes(part_url(ctx, index, count)))
    except FileNotFoundError:
        return None
    if part["config_hash"] == ctx.config_hash:
        return part
    if merging:
        print(f"generate: part {index} of {count} holds the output of other settings; the manifest is committed "
              f"once part {index} has run with these", flush=True)
    return None


def invalidate(ctx: StageContext) -> None:
    """A part removes only its own output (other parts may be running); a single process removes everything."""
    index, count = part_of(ctx)
    stream.forget(ctx.url, index)  # first: a streaming label must not follow records whose shards are going
    storage.remove(storage.join(ctx.url, manifest.MANIFEST))
    if count == 1:  # its shards are every part's: no part's record may list them
        manifest.invalidate(ctx.url)
        storage.remove(storage.join(ctx.url, "parts"), recursive=True)
        return
    # This index's shard names are the same for every part count: records of other counts would list shards that
    # are about to be replaced
    for record in storage.glob_under(storage.join(ctx.url, "parts"), f"part-{index:05d}-of-*.json"):
        storage.remove(record)
    for url in storage.glob_under(ctx.url, "shard-*.tar"):
        # the whole number: part 10 and up number their shards past six digits (shard-1000000.tar)
        if int(url.rsplit("shard-", 1)[1].split(".", 1)[0]) // PART_SHARD_STRIDE == index:
            storage.remove(url)


class Backend:
    """Formats prompts and measures their length with the policy's tokenizer; subclasses sample."""

    engine = "transformers"  # what computes the samples, recorded in gen.json

    def format(self, prompts: list[str]) -> list[str]:
        return format_prompts(self.tokenizer, self.cfg.policy, prompts)

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in prompt_token_ids(self.tokenizer, texts)]  # a part may have no prompts: []


class TransformersBackend(Backend):
    def __init__(self, cfg):
        self.cfg, self.g = cfg, cfg.generate
        self.tokenizer, self.model = load_policy(cfg.policy)
        self.device = distributed.local_device()
        self.model.to(self.device)

    def sample(self, texts: list[str], seeds: list[int]) -> list[tuple[str, int]]:
        """(response text, response tokens) per (prompt text, seed)."""
        return sample_texts(self.model, self.tokenizer, texts, seeds, self.device, self.g)


class VLLMBackend(Backend):
    """vLLM on GPUs (the `vllm` extra): per-request seeds, so samples match the contract above (not the same tokens
    as the transformers backend: different kernels)."""

    engine = "vllm"

    def __init__(self, cfg):
        try:
            from vllm import LLM, SamplingParams, TokensPrompt
        except ImportError:
            raise UserError("generate.backend=vllm needs vLLM on a GPU machine: pip install 'rlaif[vllm]'") from None
        self.cfg, self.g, self.SamplingParams, self.TokensPrompt = cfg, cfg.generate, SamplingParams, TokensPrompt
        self.llm = LLM(model=str(resolve_policy(cfg.policy)), seed=cfg.seed,
                       trust_remote_code=cfg.policy.trust_remote_code)
        self.tokenizer = self.llm.get_tokenizer()

    def sample(self, texts: list[str], seeds: list[int]) -> list[tuple[str, int]]:
        g = self.g
        params = [self.SamplingParams(n=1, seed=s, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or -1,
                                      max_tokens=g.max_new_tokens, stop=g.stop or None) for s in seeds]
        prompts = [self.TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids(self.tokenizer, texts)]
        outs = self.llm.generate(prompts, params, use_tqdm=False)  # ids: vLLM would add a BOS of its own to text
        return [(o.outputs[0].text.strip(), len(o.outputs[0].token_ids)) for o in outs]


class EndpointBackend(Backend):
    """An `rlaif serve` service of this config's policy (generate.endpoint): one request per sample with its own seed,
    padded as the in-process micro-batch pads it, spread over the service's replicas; a failed request is retried,
    so a replica dying mid-run loses no pair and, the seed being the sample's, duplicates none."""

    def __init__(self, cfg):
        from rlaif.models.loading import policy_tokenizer
        from rlaif.serving.client import ServiceClient
        from rlaif.serving.identity import check_service, policy_digest

        self.cfg, self.g = cfg, cfg.generate
        self.client = ServiceClient(self.g.endpoint, "generate.endpoint")
        self.engine = check_service(self.client, "policy", policy_digest(cfg.policy), self.g.endpoint_engine)["engine"]
        self.tokenizer = policy_tokenizer(resolve_policy(cfg.policy), cfg.policy)

    def sample(self, texts: list[str], seeds: list[int]) -> list[tuple[str, int]]:
        g, width = self.g, max(self.lengths(texts))
        bodies = [{"prompt": text, "seed": seed, "max_tokens": g.max_new_tokens, "temperature": g.temperature,
                   "top_p": g.top_p, "top_k": g.top_k or -1, "stop": g.stop, "pad_to_tokens": width}
                  for text, seed in zip(texts, seeds)]
        return [(r["choices"][0]["text"], self.completion_tokens(r)) for r in self.client.completions(bodies)]

    def completion_tokens(self, answer: dict) -> int:
        """The service's count (usage is optional in the API), else the policy tokenizer's of the text."""
        usage = answer.get("usage")
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        return len(self.tokenizer(answer["choices"][0]["text"], add_special_tokens=False)["input_ids"])


BACKENDS = {"transformers": TransformersBackend, "vllm": VLLMBackend, "endpoint": EndpointBackend}


def micro_batches(lengths: list[int], per_prompt: int, batch_size: int, bucketing: bool) -> list[list[int]]:
    """Prompt indices per micro-batch of at most batch_size sequences; by length when bucketing (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i]) if bucketing else list(range(len(lengths)))
    step = max(1, batch_size // per_prompt)
    return [order[i : i + step] for i in range(0, len(order), step)]


def generate_part(cfg, backend, rows: list[dict], writer: ShardWriter, desc: str) -> dict:
    """Samples this part's pairs into `writer`; returns the counts for the summary."""
    g = cfg.generate
    texts = backend.format([r["prompt"] for r in rows])
    lengths = backend.lengths(texts)
    if lengths and (model := getattr(backend, "model", None)) is not None:  # before anything is written
        longest = max(range(len(rows)), key=lengths.__getitem__)
        check_fits(model, lengths[longest], g.max_new_tokens, f"prompt {rows[longest]['id']!r} (formatted)")
    counts = {"prompts": len(rows), "pairs": 0, "tokens": 0, "sequences": 0, "identical_pairs": 0, "resampled_pairs": 0,
              "dropped_identical": 0}
    for step, batch in enumerate(progress(micro_batches(lengths, g.samples_per_prompt, g.batch_size,
                                                        g.length_bucketing),
                                          desc=desc, unit="batch", disable=not distributed.is_main()), 1):
        jobs = [(i, j) for i in batch for j in range(g.samples_per_prompt)]
        results = backend.sample([texts[i] for i, _ in jobs],
                                 [sample_seed(cfg.seed, rows[i]["id"], j) for i, j in jobs])
        samples: dict[int, list] = {i: [] for i in batch}
        for (i, j), (text, n_tokens) in zip(jobs, results):
            samples[i].append((j, text, n_tokens))
            counts["tokens"] += n_tokens
        counts["sequences"] += len(jobs)
        pending = [i for i in batch if not distinct_pair(samples[i])]
        counts["identical_pairs"] += len(pending)
        extra = g.samples_per_prompt
        while pending and g.identical_pairs == "resample" and extra < g.samples_per_prompt + g.max_resamples:
            results = backend.sample([texts[i] for i in pending],
                                     [sample_seed(cfg.seed, rows[i]["id"], extra) for i in pending])
            for i, (text, n_tokens) in zip(pending, results):
                samples[i].append((extra, text, n_tokens))
                counts["tokens"] += n_tokens
            counts["sequences"] += len(pending)
            counts["resampled_pairs"] += len(pending)
            pending = [i for i in pending if not distinct_pair(samples[i])]
            extra += 1
        for i in sorted(batch):  # written batch by batch: a part never holds more than one batch in memory
            pair = distinct_pair(samples[i]) or (samples[i][:2] if g.identical_pairs == "keep" else None)
            if pair is None:
                counts["dropped_identical"] += 1
                continue
            writer.write({"__key__": rows[i]["id"], "prompt.txt": rows[i]["prompt"], "response_a.txt": pair[0][1],
                          "response_b.txt": pair[1][1],
                          "gen.json": {"policy": cfg.policy.model, "sample_a": pair[0][0], "sample_b": pair[1][0],
                                       "tokens_a": pair[0][2], "tokens_b": pair[1][2], "backend": backend.engine}})
            counts["pairs"] += 1
        faults.maybe_kill("generate", step, distributed.rank())
    return counts


def distinct_pair(samples: list[tuple]) -> list[tuple] | None:
    """The first sample and the first one after it with different text, or None."""
    for other in samples[1:]:
        if other[1] != samples[0][1]:
            return [samples[0], other]
    return None


def require_pairs(n_pairs: int, g) -> None:
    if n_pairs == 0:
        raise UserError("generate: every pair was dropped as identical (the policy samples the same response twice): "
                        f"raise generate.temperature (now {g.temperature}) or set generate.identical_pairs=keep")


def merge(ctx: StageContext, count: int) -> dict | None:
    """The stage manifest over all parts, once every part has written its part file for this config; else None."""
    parts = []
    for index in range(count):  # stops at the first part not written yet (one read, not `count`, while parts run)
        parts.append(read_part(ctx, index, count, merging=True))
        if parts[-1] is None:
            return None
    summary = {k: sum(p["summary"][k] for p in parts) for k in parts[0]["summary"] if k != "seconds"}
    summary["seconds"] = max(p["summary"]["seconds"] for p in parts)
    summary["tokens_per_s"] = summary["tokens"] / max(summary["seconds"], 1e-9)
    summary["parts"] = count
    require_pairs(summary["pairs"], ctx.cfg.generate)
    return ctx.commit(shards=[s for p in parts for s in p["shards"]], summary=summary)


def run(ctx: StageContext) -> dict | None:
    index, count = part_of(ctx)
    recorder = stream.PartRecorder(ctx.url, index, count, ctx.config_hash)
    try:
        return run_part(ctx, index, count, recorder)
    except BaseException as exc:  # interrupted too: a streaming label stops instead of waiting for its timeout
        with contextlib.suppress(Exception):  # storage failing here too: the original error is the one to show
            recorder.failed(exc)
        raise


def run_part(ctx: StageContext, index: int, count: int, recorder: stream.PartRecorder) -> dict | None:
    cfg, g = ctx.cfg, ctx.cfg.generate
    if count > 1 and ctx.num_parts == 1:
        distributed.setup()  # torchrun ranks: the process group for the barrier before rank 0 merges
    prompts = split(cfg.data, "train")[: g.max_prompts]
    rows = prompts[index::count]
    if count > 1 and read_part(ctx, index, count):
        print(f"generate: part {index} of {count} already written for this config, skipped")
    else:
        backend = BACKENDS[g.backend](cfg)
        start = time.time()
        with ShardWriter(ctx.url, g.shard_size, first_index=index * PART_SHARD_STRIDE if count > 1 else 0,
                         on_shard=recorder.shard) as writer:
            counts = generate_part(cfg, backend, rows, writer,
                                   "generate" if count == 1 else f"generate {index}/{count}")
        recorder.end()
        counts["seconds"] = time.time() - start
        if isinstance(backend, EndpointBackend):  # a retry is a replica that failed or a request that timed out
            counts.update(endpoint_requests=backend.client.stats["requests"],
                          endpoint_retries=backend.client.stats["retries"])
        print(f"generate{f' part {index}/{count}' if count > 1 else ''}: {counts['pairs']} pairs "
              f"from {len(rows)} prompts, "
              f"{counts['tokens']} tokens in {counts['seconds']:.1f}s "
              f"({counts['tokens'] / max(counts['seconds'], 1e-9):.0f} tok/s), "
              f"{counts['identical_pairs']} identical pairs ({counts['resampled_pairs']} resamples, "
              f"{counts['dropped_identical']} dropped)")
        if count == 1:
            require_pairs(counts["pairs"], g)
            return ctx.commit(shards=writer.shards,
                              summary={**counts, "tokens_per_s": counts["tokens"] / max(counts["seconds"], 1e-9),
                                       "parts": 1})
        record = {"config_hash": ctx.config_hash, "shards": writer.shards, "summary": counts}
        storage.write_bytes_atomic(part_url(ctx, index, count), json.dumps(record).encode())
    if ctx.num_parts == 1:  # torchrun: everyone has written, then rank 0 merges
        distributed.barrier()
        return merge(ctx, count) if distributed.is_main() else None
    merged = merge(ctx, count)
    print(f"generate: all {count} parts written, manifest committed" if merged else
          f"generate: part {index} of {count} written; the last part to finish commits the manifest")
    return merged
