"""How well each AI-judge setting ranks responses of known quality: the demo data's answer templates (good: all three
steps of the task, polite; mediocre: one step, hedging; bad: rude or off-topic) filled in for the same prompt, every
pair of different tiers compared in both orders. Agreement = the share of pairs where the judge prefers the better
tier; good-vs-mediocre is the hard part (the hedge that the demo's first policy learned to say).

    .venv/bin/python bench/bench_judge_agreement.py [--prompts 400] [--append]
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

import yaml

from rlaif.config import JudgeSettings
from rlaif.judges import make_judge
from rlaif.judges.constitution import compare, load_constitution

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(Path(__file__).parent))
import make_demo_data as demo  # noqa: E402
from common import publish  # noqa: E402

TIERS = ((2, demo.GOOD), (1, demo.MEDIOCRE), (0, demo.BAD))


def candidates(n_prompts: int, seed: int = 0) -> list[tuple[str, list[str], list[tuple[str, int]]]]:
    """Per prompt: the text, its key points, and two filled templates of each tier."""
    rng = random.Random(seed)
    tasks = [(task, steps) for topic in demo.TASKS.values() for task, steps in topic]
    out = []
    for _ in range(n_prompts):
        task, steps = rng.choice(tasks)
        fields = dict(task=task, s0=steps[0], s1=steps[1], s2=steps[2], S0=steps[0][0].upper() + steps[0][1:])
        answers = [(t.format(**fields), tier) for tier, pool in TIERS for t in rng.sample(pool, 2)]
        out.append((rng.choice(demo.PROMPT_TEMPLATES).format(task=task), steps, answers))
    return out


def agreement(judge, principles, mode, items) -> tuple[float, float]:
    """(all tiers, good vs mediocre): share of different-tier pairs the judge orders like the tiers."""
    prompts, first, second, better, hard = [], [], [], [], []
    for prompt, _, answers in items:
        for (a, ta), (b, tb) in itertools.combinations(answers, 2):
            if ta != tb:
                prompts.append(prompt), first.append(a), second.append(b)
                better.append(ta > tb), hard.append(min(ta, tb) == 1)
    p = compare(judge, principles, mode, 0, [str(i) for i in range(len(prompts))], prompts, first, second)[0]
    right = [(pk > 0.5) == bk for pk, bk in zip(p.tolist(), better)]
    return sum(right) / len(right), sum(r for r, h in zip(right, hard) if h) / sum(hard)


def without_contrast(path: str, tmp: Path) -> str:
    principles = [{k: v for k, v in p.items() if k != "contrast"} for p in load_constitution(path)]
    out = tmp / Path(path).name
    out.write_text(yaml.safe_dump(principles))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args()
    items = candidates(args.prompts)
    references = {prompt: steps for prompt, steps, _ in items}
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    rows = []
    for name, path in (("training (data/constitution.yaml)", "data/constitution.yaml"),
                       ("held-out (data/constitution_heldout.yaml)", "data/constitution_heldout.yaml")):
        plain = without_contrast(path, tmp)
        for label, constitution, mode, relevance in (
                ("principle only, one sampled", plain, "sample", 0.0),
                ("+ prompt relevance 0.5 (the demo's setting before)", plain, "sample", 0.5),
                ("+ all principles (ensemble)", plain, "all", 0.5),
                ("principle minus contrast, one sampled, relevance 0.5", path, "sample", 0.5),
                ("principle minus contrast, all principles, relevance 0.5 (the demo's setting now)", path, "all", 0.5)):
            settings = JudgeSettings(judge="embedding", constitution=constitution, principles=mode,
                                     relevance_weight=relevance)
            judge = make_judge(settings, 256)
            overall, hard = agreement(judge, load_constitution(constitution), mode, items)
            rows.append(f"| {name} | {label} | {overall:.3f} | {hard:.3f} |")
    reference = make_judge(JudgeSettings(judge="reference"), 256, references)
    overall, hard = agreement(reference, [{"name": "reference", "text": ""}], "sample", items)
    rows.append(f"| - | reference judge (key points + rules; no model) | {overall:.3f} | {hard:.3f} |")
    table = ("| constitution | embedding-judge setting | agreement with quality tiers | good vs mediocre |\n"
             "|---|---|---|---|\n"
             + "\n".join(rows))
    publish(f"AI judge vs the demo data's quality tiers ({args.prompts} prompts, 6 answers each, all different-tier "
            "pairs, both orders)", table, args.append)


if __name__ == "__main__":
    main()
