"""Examples chosen to teach rather than the first N: the prompts where the judges disagree most (when there is more
than one judge), and those whose reward-model score rose or fell most from the starting policy's answer to the tuned
policy's. Each pick says why it was chosen; the kinds take turns until N are chosen, and no prompt is shown twice."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pick:
    why: str
    example: dict


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def disagreement(example: dict) -> tuple[float, str] | None:
    """(spread of the judges' P(tuned better), why) for a prompt more than one judge scored."""
    p = {k: v for k, v in (example.get("p_tuned_better") or {}).items() if _number(v)}
    if len(p) < 2:
        return None
    hi, lo = max(p, key=p.get), min(p, key=p.get)
    return p[hi] - p[lo], f"judges disagree: P(tuned better) '{hi}' {p[hi]:.2f}, '{lo}' {p[lo]:.2f}"


def reward_change(example: dict) -> float | None:
    """The tuned answer's reward-model score minus the starting answer's."""
    tuned, start = example.get("reward_tuned"), example.get("reward_reference")
    return tuned - start if _number(tuned) and _number(start) else None


def _ranked(examples: list[dict]) -> list[list[tuple[int, str]]]:
    """Each kind's candidates, best first, as (index, why)."""
    spread = [(d[0], i, d[1]) for i, x in enumerate(examples) if (d := disagreement(x)) and d[0] > 0]
    changes = [(c, i) for i, x in enumerate(examples) if (c := reward_change(x)) is not None]

    return [[(i, reason) for _, i, reason in sorted(spread, key=lambda s: (-s[0], s[1]))],
            [(i, f"biggest reward gain: {c:+.3f}") for c, i in sorted(changes, key=lambda s: (-s[0], s[1])) if c > 0],
            [(i, f"biggest reward loss: {c:+.3f}") for c, i in sorted(changes) if c < 0]]


def _notes(examples: list[dict], kinds: list[list]) -> list[str]:
    notes = []
    if examples and not any(disagreement(x) for x in examples):
        notes.append("One judge only: no disagreements between judges to show.")
    elif examples and not kinds[0]:
        notes.append("The judges agree on every prompt.")
    if any(reward_change(x) is not None for x in examples):
        if not kinds[1]:
            notes.append("No tuned answer scored higher than the starting answer.")
        if not kinds[2]:
            notes.append("No tuned answer scored lower than the starting answer.")
    return notes


def choose(examples: list[dict], n: int) -> tuple[list[Pick], list[str]]:
    """Up to n picks grouped by kind (disagreements, gains, losses), and notes on kinds with nothing to show."""
    kinds = _ranked(examples)
    picked: list[list[tuple[int, str]]] = [[] for _ in kinds]
    taken: set[int] = set()
    queues = [list(kind) for kind in kinds]
    while len(taken) < n and any(queues):
        for queue, chosen in zip(queues, picked):
            while queue and queue[0][0] in taken:
                queue.pop(0)
            if queue and len(taken) < n:
                taken.add(queue[0][0])
                chosen.append(queue.pop(0))
    picks = [Pick(why, examples[i]) for chosen in picked for i, why in chosen]
    if not picks and n > 0:  # an older run's examples without rewards, judged by one judge
        picks = [Pick("one of the first held-out prompts (nothing to choose by)", x) for x in examples[:n]]
    return picks, _notes(examples, kinds)
