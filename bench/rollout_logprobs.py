"""ppo.rollout_logprobs: how far the old log-probs and values taken from the sampler's own hidden states (`sampled`)
are from a forward over the finished rollout (`recompute`), on the same sampled tokens, in fp32 and under bf16
autocast, and what the forward it saves costs.

The demo's policy (the built-in tiny Llama after its warm-start) with LoRA r16 as PPO builds it, its adapter's B and
the value head drawn at random (both start at zero, which would make the adapter fold and the value columns trivially
exact); 64 training prompts, 48 new tokens at the demo's temperature, sampled as the stage samples (fp32 CPU
weights: the adapter folded into the base weights). bf16 runs here on the CPU under torch.autocast (slow, but the
rounding is bf16's; the adapter is not folded under autocast); on GPUs the stage recomputes under bf16.

    .venv/bin/python bench/rollout_logprobs.py [--append] [--size demo|h512x8]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_ppo import SIZES, shared_models  # noqa: E402
from common import publish  # noqa: E402

from rlaif.distributed import clock  # noqa: E402

PROMPTS, TOKENS = 64, 48


def compare(cfg, policy, tokenizer, texts: list[str], precision: str) -> dict:
    from rlaif.models.adapters import adapter_folded
    from rlaif.models.generation import encode_prompts, response_mask, sample

    enc = encode_prompts(tokenizer, texts, torch.device("cpu"))
    def cast():  # a fresh context per block (an autocast object is not re-entered)
        return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    with torch.no_grad(), cast(), adapter_folded(policy.lm):
        responses, hidden = sample(policy.lm, tokenizer, enc, max_new_tokens=TOKENS,
                                   temperature=cfg.ppo.temperature, seed=0, want_hidden=True)
    with torch.no_grad(), cast():
        mask = response_mask(responses, tokenizer.eos_token_id)
        start = clock()
        sampled_logprobs, sampled_values = policy.from_hidden(hidden, responses)
        from_hidden_s = clock() - start
        start = clock()
        logprobs, _, values = policy(enc["input_ids"], enc["attention_mask"], responses, mask)
        forward_s = clock() - start
    real = mask.bool()
    dlp = (sampled_logprobs - logprobs)[real].abs()
    dv = (sampled_values.float() - values.float())[real].abs()
    ratio = (sampled_logprobs - logprobs)[real].exp().sub(1).abs()
    return {"precision": precision, "tokens": int(real.sum()), "lp_max": dlp.max().item(),
            "lp_mean": dlp.mean().item(), "ratio_max": ratio.max().item(), "v_max": dv.max().item(),
            "v_mean": dv.mean().item(), "forward_s": forward_s, "from_hidden_s": from_hidden_s}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--append", action="store_true")
    p.add_argument("--size", choices=["demo", "h512x8"], default="demo")
    p.add_argument("--work", default="runs")
    a = p.parse_args()
    from rlaif import distributed as dist
    from rlaif.config import load_config
    from rlaif.io.prompts import split
    from rlaif.models.policy import build_policy
    from rlaif.models.prompt_text import format_prompts

    assert a.size in SIZES
    policy_dir, _ = shared_models(Path(a.work), a.size)
    cfg = load_config("configs/demo.yaml", [f"policy.model={policy_dir}"] if a.size != "demo" else [])
    dist.setup()
    tokenizer, policy, _ = build_policy(cfg, torch.device("cpu"))
    torch.manual_seed(1)
    torch.nn.init.normal_(policy.value_head.weight, std=policy.value_head.in_features ** -0.5)
    for name, param in policy.lm.named_parameters():
        if "lora_B" in name:  # a trained adapter's scale
            torch.nn.init.normal_(param, std=0.02)
    policy.eval()
    texts = format_prompts(tokenizer, cfg.policy, [r["prompt"] for r in split(cfg.data, "train")[:PROMPTS]])
    rows = [compare(cfg, policy, tokenizer, texts, precision) for precision in ("fp32", "bf16")]
    lines = ["| precision | response tokens | log-prob abs diff, max / mean | max abs(ratio - 1) | value abs diff, "
             "max / mean | recomputed forward s | from hidden states s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['tokens']:,} | {r['lp_max']:.2e} / {r['lp_mean']:.2e} | "
                     f"{r['ratio_max']:.2e} | {r['v_max']:.2e} / {r['v_mean']:.2e} | {r['forward_s']:.3f} | "
                     f"{r['from_hidden_s']:.3f} |")
    publish(f"Rollout log-probs from the sampler vs recomputed (policy {a.size}, LoRA r16, {PROMPTS} prompts x "
            f"{TOKENS} tokens)", "\n".join(lines) + "\n", a.append)


if __name__ == "__main__":
    main()
