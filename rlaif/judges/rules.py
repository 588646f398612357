"""Rules judge: deterministic checks (length, keywords, format), for tests and rule-based rewards. A response's score
is the fraction of checks it passes; the pairwise label is sigmoid((score_first - score_second) / temperature)."""
from __future__ import annotations

import re

import torch


class RulesJudge:
    def __init__(self, rules, temperature: float):
        self.rules = rules
        self.temperature = temperature
        self.pattern = re.compile(rules.pattern) if rules.pattern else None  # the config checked that it compiles
        self.name = "rules"

    def check(self, response: str) -> float:
        r = self.rules
        words = len(response.split())
        text = response.lower()
        passed = [r.min_words <= words and (r.max_words is None or words <= r.max_words)]
        passed += [k.lower() in text for k in r.required]
        passed += [k.lower() not in text for k in r.forbidden]
        if self.pattern is not None:
            passed.append(self.pattern.search(response) is not None)
        return sum(passed) / len(passed)

    def prefer_first(self, prompts, first, second, principles) -> torch.Tensor:
        s1 = torch.tensor([self.check(t) for t in first])
        s2 = torch.tensor([self.check(t) for t in second])
        return torch.sigmoid((s1 - s2) / self.temperature)

    def direct_score(self, prompts, responses, principles) -> torch.Tensor:
        return torch.tensor([2.0 * self.check(t) - 1.0 for t in responses])
