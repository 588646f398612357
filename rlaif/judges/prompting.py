"""The LLM judges' prompts (hf and openai share them): a preamble, the sampled principle, optional worked examples,
the request and the two responses; the answer ("1" or "2") or a 1-10 score is read after a fixed cue."""
from __future__ import annotations

from rlaif.errors import UserError
from rlaif.io.user_files import read_user_jsonl

ANSWER_CUE = "\nPreferred response:"
ANSWERS = (" 1", " 2")
RATIONALE_CUE = "\nRationale:"
SCORE_CUE = "\nScore (1 to 10):"
SCORES = tuple(range(1, 11))


def score_candidate(k: int) -> str:
    """A score as a whole continuation: " 7/10" (the "/10" tells "1" from the start of "10")."""
    return f" {k}/10"


FEW_SHOT_TEXTS = ("prompt", "response_1", "response_2")
FEW_SHOT_KEYS = (*FEW_SHOT_TEXTS, "preferred", "rationale")


def load_few_shot(path: str | None) -> list[dict]:
    """The worked examples of label.few_shot (JSONL: prompt, response_1, response_2, preferred 1 or 2, optional
    rationale); every row checked, since a judge reads them into every prompt it writes."""
    if not path:
        return []
    rows = [row for _, row in read_user_jsonl(path, "few-shot file",
                                              "set label.few_shot to a JSONL file of worked examples")]
    if not rows:
        raise UserError(f"few-shot file {path} has no examples: add JSONL rows of {', '.join(FEW_SHOT_KEYS[:4])}, "
                        "or leave label.few_shot out for a zero-shot judge")
    for line, row in enumerate(rows, 1):
        problem = few_shot_problem(row)
        if problem:
            raise UserError(f"few-shot file {path}, line {line}: {problem}")
    return rows


def few_shot_problem(row) -> str | None:
    """What is wrong with one worked example, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object of {', '.join(FEW_SHOT_KEYS[:4])}"
    unknown = sorted(set(row) - set(FEW_SHOT_KEYS))
    if unknown:
        return f"unknown key {unknown[0]!r}: a worked example has {', '.join(FEW_SHOT_KEYS)} (optional)"
    missing = [key for key in (*FEW_SHOT_TEXTS, "preferred") if key not in row]
    if missing:
        return f"needs {missing[0]!r}: a worked example has prompt, response_1, response_2 and preferred (1 or 2)"
    if not all(isinstance(row[key], str) and row[key].strip() for key in FEW_SHOT_TEXTS):
        return "prompt, response_1 and response_2 must be non-empty strings"
    if type(row["preferred"]) is not int or row["preferred"] not in (1, 2):  # not True, not 2.0: written as given
        return f"preferred must be the number 1 or 2, got {row['preferred']!r}"
    if "rationale" in row and not (isinstance(row["rationale"], str) and row["rationale"].strip()):
        return "rationale, where given, must be a non-empty string"
    return None


def _comparison(prompt: str, first: str, second: str) -> str:
    return f"Request: {prompt}\nResponse 1: {first}\nResponse 2: {second}"


def pairwise_prompt(preamble: str, principle: str, examples: list[dict], prompt: str, first: str, second: str,
                    chain_of_thought: bool) -> str:
    """Everything before the answer: ends with RATIONALE_CUE (chain of thought) or ANSWER_CUE."""
    shots = ""
    for ex in examples:
        rationale = f"{RATIONALE_CUE} {ex['rationale']}" if chain_of_thought and ex.get("rationale") else ""
        shots += (f"{_comparison(ex['prompt'], ex['response_1'], ex['response_2'])}{rationale}{ANSWER_CUE} "
                  f"{ex['preferred']}\n\n")
    cue = RATIONALE_CUE if chain_of_thought else ANSWER_CUE
    return f"{preamble}\nPrinciple: {principle}\n\n{shots}{_comparison(prompt, first, second)}{cue}"


def after_rationale(prompt_with_cue: str, rationale: str) -> str:
    """The prompt continued by the judge's rationale, up to the answer cue."""
    return f"{prompt_with_cue} {rationale.strip()}{ANSWER_CUE}"


def score_prompt(preamble: str, principle: str, prompt: str, response: str) -> str:
    return (f"{preamble}\nRate how well the response follows the principle, from 1 (not at all) to 10 (fully).\n"
            f"Principle: {principle}\n\nRequest: {prompt}\nResponse: {response}{SCORE_CUE}")
