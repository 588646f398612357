"""Reference judge: a verifiable, reference-based grader (MT-Bench's reference-guided grading, done by rules).

Prompts may carry `key_points` (a list of short statements a good answer makes) or a `reference` answer (split into
sentences, each a key point). A response's score is the fraction of key points it covers, minus penalties for the
constitution rules a program can check: rudeness (a phrase from `rude_terms`) and going off topic (no content word
shared with the prompt or its key points). A key point is covered when the response contains at least
`min_point_overlap` of its content words (lower-cased, stop words removed, plural/-ing/-ed endings stripped).

It has no model and cannot be gamed by style: it measures what a policy says, not how close its wording sits to a
principle, so it is the ground truth the demo's reports compare the AI judges against. It grades only prompts with
references; the pairwise label is sigmoid((score_first - score_second) / temperature), and equal scores are an exact
tie.
"""
from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING

from rlaif.errors import UserError

if TYPE_CHECKING:
    import torch

STOP_WORDS = frozenset("""
a an the and or but if then than so to of in on at by for with from into onto about as is are was were be been being
am do does did doing have has had having it its it's this that these those there here i you your yours he she we they
them their our my me him her us what which who whom whose when where why how all any each every some no not nor only
own same too very can could will would should shall may might must just also up down out over under again further once
more most other such both few until while before after above below between through during per via one
""".split())
REFERENCE_TEMPERATURE = 0.05  # one key point of three apart is p = 0.9988: a clear preference
# the reference judge prefers one answer clearly when |p - 0.5| >= this (the evaluation's tie margin)
CLEAR_MARGIN = 0.05
# Scripts written without spaces between words (CJK, Thai, Lao, Khmer, Myanmar): a run of them is read as its
# overlapping character pairs.
UNSPACED = re.compile(r"[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                      r"\uf900-\ufaff]")


def words(text: str) -> list[str]:
    """Runs of letters, digits and combining marks of any script (Cyrillic, accented Latin, Devanagari's vowel
    signs), with an English possessive or contraction kept: "dog's", "don't"."""
    found, current = [], []
    for char in text:
        if unicodedata.category(char)[0] in "LNM" or (char in "'’" and current):
            current.append("'" if char == "’" else char)
        elif current:
            found.append("".join(current).strip("'"))
            current = []
    if current:
        found.append("".join(current).strip("'"))
    return [word for word in found if word]


def stem(word: str) -> str:
    """A crude stem that maps rate/rates/rated/rating and dish/dishes to one form."""
    word = word.removesuffix("'s")
    for suffix in ("ing", "ed", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def content_words(text: str) -> set[str]:
    found = set()
    for word in words(text.lower()):
        if UNSPACED.search(word):
            found.update(word[i : i + 2] for i in range(max(1, len(word) - 1)))
        elif word not in STOP_WORDS:
            found.add(stem(word))
    return found


def check_points(rows: list[dict]) -> None:
    """Every key point has a word the judge can match: one of stop words or punctuation alone would count as
    covered by every response. A reference answer, read where a row has no key points, needs a sentence that has
    one (else the prompt would have no key point, and evaluate would leave the reference judge out)."""
    for row in rows:
        for point in row.get("key_points") or []:
            if not content_words(point):
                raise UserError(f"judge 'reference': key point {point[:60]!r} of prompt {row.get('id', '')!r} has no "
                                "word it can match (only stop words, punctuation or symbols): write what a good answer "
                                "says")
        reference = row.get("reference")
        if not row.get("key_points") and isinstance(reference, str) and reference.strip() \
                and not split_reference(reference):
            raise UserError(f"judge 'reference': the reference answer {reference[:60]!r} of prompt "
                            f"{row.get('id', '')!r} has no word it can match (only stop words, punctuation or "
                            "symbols): write what a good answer says")


def split_reference(reference: str) -> list[str]:
    """A reference answer's key points: its sentences and semicolon-separated clauses."""
    return [part.strip() for part in re.split(r"(?<=[.!?;])\s+|;", reference) if content_words(part)]


class ReferenceJudge:
    name = "reference"

    def __init__(self, settings, temperature: float, references: dict[str, list[str]] | None):
        if not references:
            raise UserError("judge 'reference' needs prompts with key points: add a 'key_points' list or a 'reference' "
                            "answer to each prompt in data.prompts")
        self.settings = settings
        self.temperature = temperature
        self.points = {prompt: [content_words(point) for point in points] for prompt, points in references.items()}
        self.rude = [re.compile(rf"(?<![a-z]){re.escape(term.lower())}(?![a-z])") for term in settings.rude_terms]

    def _points(self, prompt: str) -> list[set[str]]:
        if prompt not in self.points:
            raise UserError(f"judge 'reference': prompt {prompt[:60]!r} has no key points in data.prompts: add "
                            "'key_points' or 'reference' to it, or use another judge")
        return self.points[prompt]

    def grade(self, prompt: str, response: str) -> dict:
        """The parts of a response's score: key points covered (of all), rude, off topic, and the score."""
        words = content_words(response)
        points = self._points(prompt)
        covered = sum(len(words & point) >= self.settings.min_point_overlap * len(point) for point in points)
        rude = any(pattern.search(response.lower()) for pattern in self.rude)
        topic = content_words(prompt).union(*points)
        off_topic = not (words & topic)
        score = covered / len(points) - self.settings.rude_penalty * rude - self.settings.off_topic_penalty * off_topic
        return {"covered": covered, "points": len(points), "rude": rude, "off_topic": off_topic,
                "score": max(-1.0, min(1.0, score))}

    def direct_score(self, prompts, responses, principles=None) -> torch.Tensor:
        import torch  # here: the launcher's checks read this module without loading torch

        return torch.tensor([self.grade(p, r)["score"] for p, r in zip(prompts, responses)], dtype=torch.float32)

    def prefer_first_where_graded(self, prompts, first, second) -> dict[int, float]:
        """P(first better) for the comparisons whose prompt has key points, by index; the others are left out."""
        index = [k for k, prompt in enumerate(prompts) if prompt in self.points]
        if not index:
            return {}
        p = self.prefer_first(*([column[k] for k in index] for column in (prompts, first, second)))
        return dict(zip(index, p.tolist()))

    def prefer_first(self, prompts, first, second, principles=None) -> torch.Tensor:
        import torch

        margin = self.direct_score(prompts, first) - self.direct_score(prompts, second)
        return torch.sigmoid(margin / self.temperature)


def reference_points(rows: list[dict]) -> dict[str, list[str]]:
    """prompt text -> key points, for the rows that carry `key_points` or a `reference`."""
    out = {}
    for row in rows:
        points = row.get("key_points") or (split_reference(row["reference"]) if row.get("reference") else [])
        if points:
            out[row["prompt"]] = points
    return out


def grader(rows: list[dict], settings) -> ReferenceJudge | None:
    """The reference judge over the key points of `rows` (prompts), or None when none carries any."""
    references = reference_points(rows)
    return ReferenceJudge(settings, REFERENCE_TEMPERATURE, references) if references else None
