"""Chosen-token log-probs (rlaif/algo/logprobs.py) against the plain form (full logits, log_softmax, gather) and,
with --against REV, against that git revision's chosen_logprobs: forward only (the reference pass, the sampler's
old log-probs) and forward + backward (the update), on one micro-batch's response tokens, in alternating rounds in
one process (the median over rounds of each round's mean; the machine's drift between runs cancels).

    .venv/bin/python bench/bench_logprobs.py [--tokens 768] [--vocab 1024] [--hidden 128 256 512] [--against REV]
        [--rounds 5] [--append]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import publish  # noqa: E402

from rlaif.algo import logprobs as current  # noqa: E402

REPEATS = 20  # calls per timing


def at_revision(rev: str) -> types.ModuleType:
    """rlaif/algo/logprobs.py as it was at `rev`, loaded as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:rlaif/algo/logprobs.py"], capture_output=True, text=True,
                            check=True).stdout
    module = types.ModuleType(f"logprobs_{rev}")
    exec(compile(source, f"{rev}:rlaif/algo/logprobs.py", "exec"), module.__dict__)
    return module


def plain(hidden, weight, bias, tokens):
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    return logp.gather(-1, tokens[:, None]).squeeze(-1), None


def ms_per_call(fn, backward: bool) -> float:
    def once():
        if backward:
            fn()[0].sum().backward()
        else:
            with torch.no_grad():
                fn()
    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(REPEATS):
        once()
    return (time.perf_counter() - start) / REPEATS * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=768, help="response tokens in a micro-batch (16 rows x 48)")
    p.add_argument("--vocab", type=int, default=1024, help="the demo tokenizer's vocabulary")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512], help="0.6M, 4M, 28M policies")
    p.add_argument("--against", help="a git revision whose chosen_logprobs to time as well")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    forms = {"plain log_softmax": plain, "chosen_logprobs": current.chosen_logprobs}
    if a.against:
        forms[f"chosen_logprobs at {a.against}"] = at_revision(a.against).chosen_logprobs
    torch.manual_seed(0)
    lines = ["| hidden | form | forward ms | forward + backward ms |", "|---|---|---|---|"]
    for hidden_size in a.hidden:
        hidden = torch.randn(a.tokens, hidden_size, requires_grad=True)
        weight = torch.randn(a.vocab, hidden_size) * hidden_size**-0.5
        tokens = torch.randint(0, a.vocab, (a.tokens,))
        times = {(name, backward): [] for name in forms for backward in (False, True)}
        for _ in range(a.rounds):
            for name, form in forms.items():
                for backward in (False, True):
                    times[name, backward].append(
                        ms_per_call(functools.partial(form, hidden, weight, None, tokens), backward))
        for name in forms:
            lines.append(f"| {hidden_size} | {name} | {statistics.median(times[name, False]):.2f} | "
                         f"{statistics.median(times[name, True]):.2f} |")
    publish(f"Chosen-token log-probs of {a.tokens} tokens at a {a.vocab:,}-token vocabulary, fp32, medians of "
            f"{a.rounds} alternating rounds of {REPEATS} calls", "\n".join(lines), a.append)


if __name__ == "__main__":
    main()
