"""One-off: the static decoder's 48-step decode at 4M parameters (h256x4, LoRA r16 folded) for GRPO's 64 rows
(16 prompts x 4 samples), run as one batch of 64 or as chunks of 32 or 16 rows, alternating over 6 rounds (the first
untimed), to split a decode step's time into a per-row part and a fixed part (BENCHMARKS.md, session 25).

    .venv/bin/python bench/decode_batch_split.py [h256x4] [16]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, "bench")
import torch
from bench_grpo import GROUP, GRPO_OVERRIDES
from bench_ppo import OVERRIDES, ROLLOUT, ours_setup, shared_models

from rlaif.io.prompts import split
from rlaif.models.decode import decode_static
from rlaif.models.generation import encode_prompts, format_prompts

size = sys.argv[1] if len(sys.argv) > 1 else "h256x4"
lora = sys.argv[2] if len(sys.argv) > 2 else "16"
policy_dir, rm_dir = shared_models(Path("runs"), size)
cfg, device, tokenizer, policy, reference_logprobs, reward_fn, engine, amp = ours_setup(
    [*OVERRIDES, f"ppo.lora_rank={lora}", "ppo.fixed_length=true", f"policy.model={policy_dir}", *GRPO_OVERRIDES], rm_dir)
prompts = split(cfg.data, "train")[: ROLLOUT // GROUP]
texts = format_prompts(tokenizer, cfg.policy, [p["prompt"] for p in prompts])
enc = encode_prompts(tokenizer, texts, device)
enc = {k: v.repeat_interleave(GROUP, 0) for k, v in enc.items()}
lm = policy.lm
from rlaif.models.adapters import adapter_folded

n = enc["input_ids"].shape[0]
seeds = list(range(n))
def run(chunk):
    outs = []
    for s in range(0, n, chunk):
        part = {k: v[s:s+chunk] for k, v in enc.items()}
        outs.append(decode_static(lm, part, seeds[s:s+chunk], max_new_tokens=48, temperature=1.0, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, min_new_tokens=48))
    return outs
times = {c: [] for c in (64, 32, 16)}
lm.eval()
with torch.no_grad(), adapter_folded(lm):
    for r in range(6):
        for c in times:
            t = time.perf_counter(); run(c); dt = time.perf_counter() - t
            if r: times[c].append(dt)
for c, v in times.items():
    print(c, round(statistics.median(v), 3), [round(x, 3) for x in v])
