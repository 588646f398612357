"""The PPO update phase's achieved FLOP/s as a fraction of this machine's measured matmul peak (model FLOPs
utilisation), at three policy sizes, with the stage's own update() on one process: fp32 on a CPU; on a GPU bf16
autocast as the stage runs it, against the measured bf16 peak, with two larger sizes added.

FLOPs are counted, not estimated: torch's FlopCounterMode records every matmul of one update (forward and backward).
The peak is the best of repeated 2048^3 fp32 matmuls with the same threads (8192^3 bf16 on a GPU). Sizes: the
demo's tiny Llama and two wider/deeper ones (random weights; throughput does not depend on them). Batch and lengths
are the demo's by default; `--large` measures 0.5B-1.6B-parameter policies in the shape a GPU deployment runs
(32k vocabulary, 128+384 tokens, minibatches of 32 sequences).

    .venv/bin/python bench/bench_ppo_update.py [--trials 3] [--append] [--large]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from rlaif import distributed as dist
from rlaif.config import load_config
from rlaif.models import generation
from rlaif.models.policy import LORA_TARGETS, PolicyWithValue
from rlaif.stages import ppo

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402

SIZES = {  # name: (hidden, layers, heads, intermediate)
    "demo tiny (h128 x2)": (128, 2, 4, 384),
    "h256 x4": (256, 4, 4, 768),
    "h512 x8": (512, 8, 8, 1536),
}
GPU_SIZES = {"h1024 x16": (1024, 16, 16, 2816), "h2048 x16": (2048, 16, 16, 5632)}
LARGE_SIZES = {"h1536 x20 (Qwen2.5-0.5B-like width)": (1536, 20, 12, 4096), "h2048 x24": (2048, 24, 16, 5632)}
ROLLOUT, MINIBATCH, PROMPT_LEN, RESPONSE_LEN, VOCAB = 64, 16, 24, 48, 1024
LARGE_SHAPE = dict(ROLLOUT=64, MINIBATCH=32, PROMPT_LEN=128, RESPONSE_LEN=384, VOCAB=32000)


def matmul_peak(repeats: int = 10) -> float:
    n, dtype = (8192, torch.bfloat16) if dist.local_device().type == "cuda" else (2048, torch.float32)
    a, b = (torch.randn(n, n, dtype=dtype, device=dist.local_device()),
            torch.randn(n, n, dtype=dtype, device=dist.local_device()))
    a @ b
    best = min(_time(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _time(fn) -> float:
    start = dist.clock()
    fn()
    return dist.clock() - start


def policy_of_size(hidden, layers, heads, intermediate, lora_rank):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, intermediate_size=intermediate,
                                      max_position_embeddings=PROMPT_LEN + RESPONSE_LEN,
                                      tie_word_embeddings=True))
    if lora_rank:
        lm = get_peft_model(lm, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=LORA_TARGETS))
    return PolicyWithValue(lm, hidden, temperature=1.0).to(dist.local_device())


def batch_for(policy) -> dict:
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (ROLLOUT, PROMPT_LEN), generator=g)
    responses = torch.randint(3, VOCAB, (ROLLOUT, RESPONSE_LEN), generator=g)
    batch = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), responses=responses,
                 mask=torch.ones_like(responses), advantages=torch.randn(ROLLOUT, RESPONSE_LEN, generator=g),
                 returns=torch.randn(ROLLOUT, RESPONSE_LEN, generator=g))
    batch = {k: v.to(dist.local_device()) for k, v in batch.items()}
    with torch.no_grad():
        logprobs, _, values = policy(batch["prompt_ids"], batch["prompt_mask"], batch["responses"], batch["mask"])
    return dict(batch, old_logprobs=logprobs, ref_logprobs=logprobs, old_values=values.float())


def measure(name, dims, lora_rank, trials) -> dict:
    cfg = load_config("configs/demo.yaml", [f"ppo.rollout_batch_size={ROLLOUT}", f"ppo.minibatch_size={MINIBATCH}",
                                            "ppo.ppo_epochs=2", f"ppo.lora_rank={lora_rank}", "ppo.lr=1e-4"])
    policy = policy_of_size(*dims, lora_rank)
    batch = batch_for(policy)
    engine = ppo.make_engine(cfg, policy, dist.local_device())
    amp = ppo.autocast(dist.local_device().type == "cuda")
    run = lambda: ppo.update(cfg, engine, batch, seed=0, kl_coef=0.05, amp=amp)  # noqa: E731
    run()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with FlopCounterMode(display=False) as counter:
        run()
    flops = counter.get_total_flops()
    seconds = statistics.median(_time(run) for _ in range(trials))
    params = sum(p.numel() for p in policy.parameters())
    peak_mib = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
    return {"peak_mib": peak_mib, "name": name, "params": params, "lora": lora_rank, "seconds": seconds, "flops": flops,
            "flops_per_s": flops / seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    p.add_argument("--large", action="store_true", help="0.5B+ policies, 32k vocabulary, 128+384 tokens (GPU)")
    p.add_argument("--full-logits", action="store_true",
                   help="log-probs through the full [tokens, vocabulary] logits (the path before algo/logprobs.py)")
    a = p.parse_args()
    if a.full_logits:
        generation.backbone_and_head = lambda model: None  # response_logprobs falls back to log_softmax over logits
    dist.avoid_per_shape_attention_plans()  # as run_stage does for every stage
    dist.setup()  # one process; sets the thread count as the stage does
    peak = matmul_peak()
    sizes = {**SIZES, **GPU_SIZES} if dist.local_device().type == "cuda" else SIZES
    if a.large:
        globals().update(LARGE_SHAPE)
        sizes = LARGE_SIZES
    rows = [measure(name, dims, lora, a.trials) for name, dims in sizes.items() for lora in (16, 0)]
    peak_what = ("bf16 matmul peak (8192^3)" if dist.local_device().type == "cuda"
                 else f"fp32 matmul peak (2048^3, {torch.get_num_threads()} threads)")
    lines = [f"{peak_what}: {peak / 1e9:.1f} GFLOP/s", "",
             f"| policy | params | training | update s ({ROLLOUT} seq x {PROMPT_LEN}+{RESPONSE_LEN} tok, minibatch "
             f"{MINIBATCH}, vocab {VOCAB}, 2 epochs) | "
             "counted GFLOP | GFLOP/s | of peak | peak GPU allocated (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.2f}M | "
                     f"{'LoRA r' + str(r['lora']) if r['lora'] else 'all weights'} | "
                     f"{r['seconds']:.2f} | {r['flops'] / 1e9:.1f} | {r['flops_per_s'] / 1e9:.1f} | "
                     f"{r['flops_per_s'] / peak:.0%} | {r['peak_mib']:.0f} |")
    table = "\n".join(lines) + "\n"
    title = "PPO update phase: model FLOPs utilisation" + (" (full-vocabulary logits)" if a.full_logits else "")
    publish(title, table, a.append)


if __name__ == "__main__":
    main()
