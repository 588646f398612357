"""The PPO update phase's achieved FLOP/s as a fraction of this machine's measured fp32 matmul peak (model FLOPs
utilisation), at three policy sizes, with the stage's own update() on one process.

FLOPs are counted, not estimated: torch's FlopCounterMode records every matmul of one update (forward and backward).
The peak is the best of repeated 2048x2048 fp32 matmuls with the same threads. Sizes: the demo's tiny Llama and
two wider/deeper ones (random weights; throughput does not depend on them). Batch and lengths are the demo's.

    .venv/bin/python bench/bench_ppo_update.py [--trials 3] [--append]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from rlaif import distributed as dist
from rlaif.config import load_config
from rlaif.models.generation import token_logprobs
from rlaif.stages import ppo

sys.path.insert(0, str(Path(__file__).parent))
from common import append  # noqa: E402

SIZES = {  # name: (hidden, layers, heads, intermediate)
    "demo tiny (h128 x2)": (128, 2, 4, 384),
    "h256 x4": (256, 4, 4, 768),
    "h512 x8": (512, 8, 8, 1536),
}
ROLLOUT, MINIBATCH, PROMPT_LEN, RESPONSE_LEN, VOCAB = 64, 16, 24, 48, 1024


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def policy_of_size(hidden, layers, heads, intermediate, lora_rank):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      intermediate_size=intermediate, max_position_embeddings=256, tie_word_embeddings=True))
    if lora_rank:
        lm = get_peft_model(lm, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=ppo.LORA_TARGETS))
    return ppo.PolicyWithValue(lm, hidden)


def batch_for(policy) -> dict:
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (ROLLOUT, PROMPT_LEN), generator=g)
    responses = torch.randint(3, VOCAB, (ROLLOUT, RESPONSE_LEN), generator=g)
    mask = torch.ones_like(responses)
    with torch.no_grad():
        logits, values = policy(prompt_ids, torch.ones_like(prompt_ids), responses, mask)
    logprobs = token_logprobs(logits, responses)
    return dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), responses=responses, mask=mask,
                old_logprobs=logprobs, ref_logprobs=logprobs, old_values=values, advantages=torch.randn(ROLLOUT, RESPONSE_LEN, generator=g),
                returns=torch.randn(ROLLOUT, RESPONSE_LEN, generator=g))


def measure(name, dims, lora_rank, trials) -> dict:
    cfg = load_config("configs/demo.yaml", [f"ppo.rollout_batch_size={ROLLOUT}", f"ppo.minibatch_size={MINIBATCH}",
                                            "ppo.ppo_epochs=2", f"ppo.lora_rank={lora_rank}", "ppo.lr=1e-4"])
    policy = policy_of_size(*dims, lora_rank)
    batch = batch_for(policy)
    engine = ppo.make_engine(cfg, policy, torch.device("cpu"))
    run = lambda: ppo.update(cfg, engine, batch, seed=0, kl_coef=0.05, amp=contextlib.nullcontext)  # noqa: E731
    run()  # warm-up
    with FlopCounterMode(display=False) as counter:
        run()
    flops = counter.get_total_flops()
    seconds = statistics.median(_time(run) for _ in range(trials))
    params = sum(p.numel() for p in policy.parameters())
    return {"name": name, "params": params, "lora": lora_rank, "seconds": seconds, "flops": flops, "flops_per_s": flops / seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    dist.setup()  # one process; sets the thread count as the stage does
    peak = matmul_peak()
    rows = [measure(name, dims, lora, a.trials) for name, dims in SIZES.items() for lora in (16, 0)]
    lines = [f"fp32 matmul peak (2048^3, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s", "",
             f"| policy | params | training | update s (64 seq x {PROMPT_LEN}+{RESPONSE_LEN} tok, 2 epochs) | counted GFLOP | GFLOP/s | of peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {'LoRA r' + str(r['lora']) if r['lora'] else 'all weights'} | "
                     f"{r['seconds']:.2f} | {r['flops'] / 1e9:.1f} | {r['flops_per_s'] / 1e9:.1f} | {r['flops_per_s'] / peak:.0%} |")
    table = "\n".join(lines) + "\n"
    if a.append:
        append("PPO update phase: model FLOPs utilisation", table)
    else:
        print(table)


if __name__ == "__main__":
    main()
