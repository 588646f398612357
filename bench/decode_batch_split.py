"""One-off: the static decoder's 48-step decode at 4M parameters (h256x4, LoRA r16 folded) for GRPO's 64 rows
(16 prompts x 4 samples), run as one batch of 64 or as chunks of 32 or 16 rows, alternating over 6 rounds (the first
untimed), to split a decode step's time into a per-row part and a fixed part (BENCHMARKS.md, session 25).

    .venv/bin/python bench/decode_batch_split.py [--size h256x4] [--lora-rank 16]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_grpo import GROUP, GRPO_OVERRIDES  # noqa: E402
from bench_ppo import OVERRIDES, ROLLOUT, SIZES, ours_setup, shared_models  # noqa: E402

from rlaif.io.prompts import split  # noqa: E402
from rlaif.models.adapters import adapter_folded  # noqa: E402
from rlaif.models.decode import decode_static  # noqa: E402
from rlaif.models.generation import encode_prompts, stop_ids  # noqa: E402
from rlaif.models.prompt_text import format_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="h256x4", choices=sorted(SIZES))
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    policy_dir, rm_dir = shared_models(Path("runs"), args.size)
    overrides = [*OVERRIDES, f"ppo.lora_rank={args.lora_rank}", "ppo.fixed_length=true", f"policy.model={policy_dir}",
                 *GRPO_OVERRIDES]
    cfg, device, tokenizer, policy, *_ = ours_setup(overrides, rm_dir)
    prompts = split(cfg.data, "train")[: ROLLOUT // GROUP]
    enc = encode_prompts(tokenizer, format_prompts(tokenizer, cfg.policy, [p["prompt"] for p in prompts]), device)
    enc = {k: v.repeat_interleave(GROUP, 0) for k, v in enc.items()}
    rows = enc["input_ids"].shape[0]
    settings = dict(max_new_tokens=48, temperature=1.0, eos_ids=stop_ids(tokenizer),
                    pad_id=tokenizer.pad_token_id, min_new_tokens=48)

    def decode(chunk: int) -> float:
        start = time.perf_counter()
        for first in range(0, rows, chunk):
            part = {k: v[first : first + chunk] for k, v in enc.items()}
            decode_static(policy.lm, part, list(range(first, first + chunk)), **settings)
        return time.perf_counter() - start

    seconds = {chunk: [] for chunk in (64, 32, 16)}
    policy.lm.eval()
    with torch.no_grad(), adapter_folded(policy.lm):
        for round_ in range(6):
            for chunk in seconds:
                elapsed = decode(chunk)
                if round_:
                    seconds[chunk].append(elapsed)
    for chunk, values in seconds.items():
        print(chunk, round(statistics.median(values), 3), [round(v, 3) for v in values])


if __name__ == "__main__":
    main()
