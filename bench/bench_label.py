"""Labeling throughput: pairs/s of each judge on the same pairs, both orders scored (position-debiased), as the
label stage runs them. Pairs: demonstration prompts with two of the shipped responses. The hf judge is a Llama of the
demo policy's size (random weights: speed only) with a tokenizer that has the answer tokens.

    .venv/bin/python bench/bench_label.py [--pairs 512] [--trials 3] [--append]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from rlaif.config import LabelConfig, load_config
from rlaif.distributed import clock
from rlaif.judges import debiased, make_judge, prompting
from rlaif.judges.constitution import load_constitution, sample_principle

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402


def judge_model(out: Path, texts: list[str], tiny) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.models.tiny import _train_tokenizer

    answers = ([prompting.ANSWER_CUE + a for a in prompting.ANSWERS] * 2000
               + [prompting.score_candidate(k) for k in prompting.SCORES])
    tokenizer = _train_tokenizer(texts + answers, tiny.vocab_size)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                                 intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
                                 num_attention_heads=tiny.num_heads,
                                 num_key_value_heads=tiny.num_heads, max_position_embeddings=1024,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=512)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    cfg = load_config("configs/demo.yaml")
    demos = [json.loads(line) for line in open(cfg.policy.tiny.demonstrations, encoding="utf-8")]
    rng = random.Random(0)
    rows = [(d["prompt"], d["response"], rng.choice(demos)["response"]) for d in demos[: a.pairs]]
    prompts, first, second = (list(x) for x in zip(*rows))
    principles = load_constitution(cfg.label.constitution)
    chosen = [sample_principle(principles, 0, str(i))["text"] for i in range(len(rows))]
    hf_dir = judge_model(Path(tempfile.mkdtemp()), [d["prompt"] + " " + d["response"] for d in demos], cfg.policy.tiny)
    judges = {
        "embedding (MiniLM-L6, the demo's)": LabelConfig(judge="embedding"),
        "rules (length, keywords, format)": LabelConfig(judge="rules",
                                                        rules={"required": ["first"], "pattern": r"\.$"}),
        "hf (Llama, demo-policy size, pairwise)": LabelConfig(judge="hf", hf={"model": str(hf_dir)}),
        "hf with chain of thought (16 tokens)": LabelConfig(judge="hf", chain_of_thought=True, rationale_tokens=16,
                                                           hf={"model": str(hf_dir)}),
    }
    results = {}
    for name, settings in judges.items():
        judge = make_judge(settings, cfg.label.batch_size)
        debiased(judge, prompts[:8], first[:8], second[:8], chosen[:8])  # warm-up
        n = len(rows) if "thought" not in name else len(rows) // 4
        times = []
        for _ in range(a.trials):
            start = clock()
            debiased(judge, prompts[:n], first[:n], second[:n], chosen[:n])
            times.append(clock() - start)
            if hasattr(judge, "_cache"):  # the embedding judge caches texts: measure it cold
                judge._cache.clear()
        results[name] = (n / statistics.median(times), n)
        print(name, results[name], flush=True)
    table = (f"| judge (both orders per pair, batch {cfg.label.batch_size}; {a.trials} trials) | pairs | pairs/s |\n"
             "|---|---|---|\n" + "".join(f"| {k} | {n} | {v:,.1f} |\n" for k, (v, n) in results.items()))
    publish("Labeling throughput", table, a.append)


if __name__ == "__main__":
    main()
