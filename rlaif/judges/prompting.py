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


def load_few_shot(path: str | None) -> list[dict]:
    if not path:
        return []
    rows = [row for _, row in read_user_jsonl(path, "few-shot file",
                                              "set label.few_shot to a JSONL file of worked examples")]
    for i, row in enumerate(rows):
        texts = ("prompt", "response_1", "response_2")
        if (not isinstance(row, dict) or not {*texts, "preferred"} <= set(row) or row["preferred"] not in (1, 2)
                or not all(isinstance(row[k], str) for k in texts)):
            raise UserError(f"few-shot file {path}, line {i + 1}: needs prompt, response_1, response_2 "
                            "and preferred (1 or 2)")
    return rows


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
