"""OpenAI-compatible endpoint judge (vLLM, TGI, llama.cpp server, a hosted API).

The same prompts as the hf judge, sent through rlaif.serving.client (bounded concurrency, a timeout per request,
retries with backoff on timeouts, connection errors, 429 and 5xx). The label is the
softmax over the answer tokens' log-probs when the server returns them, else the parsed answer (1 -> 1.0, 2 -> 0.0,
anything else 0.5, counted). The API key comes from the environment variable that the config names.
"""
from __future__ import annotations

import math
import re

from rlaif.errors import UserError, one_line, redact
from rlaif.judges import prompting
from rlaif.serving.client import RETRYABLE, ServiceClient


def _unlisted_bound(top: dict[str, float]) -> float:
    """A log-prob no answer outside the listed top-k can exceed: the least likely listed token's (the list is the
    top-k), or the mass the listed tokens leave, whichever is smaller. With one token listed the first is that token
    itself, and would read a confident answer as a tie."""
    left = 1.0 - sum(math.exp(v) for v in top.values())
    return min(min(top.values()), math.log(max(left, 1e-12)))  # servers round: listed mass can reach 1


class OpenAIJudge:
    def __init__(self, settings):
        o = settings.openai
        if not o.base_url or not o.model:
            raise UserError(f"judge 'openai' needs {settings.setting}.openai.base_url (e.g. http://vllm:8000/v1) "
                            f"and {settings.setting}.openai.model")
        self.settings, self.cfg = settings, o
        self.client = ServiceClient(o, f"{settings.setting}.openai")
        self.path = "/completions" if o.api == "completions" else "/chat/completions"
        self.url = self.client.base_url + self.path
        self.name = f"openai:{o.model}"
        self.examples = prompting.load_few_shot(settings.few_shot)
        # the client's request and retry counts, and how each answer was read
        self.stats = self.client.stats
        self.stats.update(answers_from_logprobs=0, answers_parsed=0, answers_unreadable=0)

    def prefer_first(self, prompts, first, second, principles):  # -> a float32 tensor of P(first preferred)
        import torch  # here: the checks before any work (a launcher's) build this judge without torch

        s = self.settings
        texts = [prompting.pairwise_prompt(s.preamble, pr, self.examples, p, a, b, s.chain_of_thought)
                 for p, a, b, pr in zip(prompts, first, second, principles)]
        labels = torch.tensor(self.client.map(self._judge_one, texts), dtype=torch.float32)
        answered, unreadable = self._answers()
        if answered >= SHARE_CHECKED_AFTER and unreadable > s.openai.max_unreadable_fraction * answered:
            self._refuse_unreadable()  # the share, over whole batches
        return labels

    def _answers(self) -> tuple[int, int]:
        """(answers read so far, those neither 1 nor 2)"""
        counted = ("answers_from_logprobs", "answers_parsed", "answers_unreadable")
        return sum(self.stats[k] for k in counted), self.stats["answers_unreadable"]

    def _refuse_unreadable(self) -> None:
        s, (answered, unreadable) = self.settings, self._answers()
        raise UserError(f"judge endpoint {self.url} answered {unreadable} of its first {answered} comparisons with "
                        f"neither 1 nor 2 (each a 0.5 label, a tie): check {s.setting}.openai.model and .api (chat "
                        f"models need `chat`), or raise {s.setting}.openai.max_unreadable_fraction")

    async def _judge_one(self, session, text: str) -> float:
        if self.settings.chain_of_thought:
            rationale, _ = await self._request(session, text, self.settings.rationale_tokens, want_logprobs=False)
            text = prompting.after_rationale(text, rationale)
        answer, top = await self._request(session, text, 1, want_logprobs=True)
        p_first = self._p_first(answer, top)
        answered, unreadable = self._answers()
        if answered >= UNREADABLE_CHECKED_AFTER and unreadable == answered:  # not judging: stop as the answer comes
            self._refuse_unreadable()
        return p_first

    def _p_first(self, answer: str, top: dict[str, float] | None) -> float:
        if top:
            lp = {a: [v for tok, v in top.items() if tok.strip() == a] for a in ("1", "2")}
            if lp["1"] or lp["2"]:
                floor = _unlisted_bound(top)
                l1, l2 = (_log_sum_exp(lp[a]) if lp[a] else floor for a in ("1", "2"))
                self.stats["answers_from_logprobs"] += 1
                return _sigmoid(l1 - l2)
        if read := ANSWER.fullmatch(answer.strip()):
            self.stats["answers_parsed"] += 1
            return 1.0 if read.group(1) == "1" else 0.0
        self.stats["answers_unreadable"] += 1
        return 0.5

    def check_serves_model(self) -> None:
        """Before any work: the service takes this judge's own one-token request for its model. Where its /models
        lists the model and the judge speaks `chat`, nothing is sent (route and fields are then found by label's
        first request); `completions` is always tried (OpenAI lists chat models that its completions route refuses).
        A server that lists one model and answers any name (TGI, llama.cpp) passes by the request; an unknown name
        (OpenAI, vLLM, Ollama: HTTP 404), a route it lacks (a base_url short of the API root), a field it does not
        take or a reply label could not read is refused here, not after generate has run. What label's requests
        wait out or retry passes: silence, 429, 500, 502, 503, 504; so does a redirect (not followed)."""
        answered, listed = self.client.check_answers()
        if not answered or (listed and self.cfg.model in listed and self.cfg.api == "chat"):
            return
        text = prompting.pairwise_prompt(self.settings.preamble, "Prefer the correct answer.", self.examples,
                                         "What is 2 + 2?", "4", "5", chain_of_thought=False)
        answer = self.client.ask_once(self.path, self._body(text, 1, want_logprobs=True))
        if answer is None or answer[0] in RETRYABLE or 300 <= answer[0] < 400:
            return
        (status, body), section = answer, self.client.section
        if status == 200:
            self._parse(self.client.json_body(self.url, body))  # a reply label could not read: refused now
            return
        served = f" (its /models lists {', '.join(listed[:5])}{', ...' if len(listed) > 5 else ''})" if listed else ""
        key = f", the API key ({self.client.key_named()})" if status in (401, 403) else ""
        raise UserError(f"{redact(self.url)} refused a one-token request for model {self.cfg.model!r} with HTTP "
                        f"{status}: {one_line(body.decode(errors='replace'), 200)!r}{served}: check {section}.model, "
                        f"{section}.api{key} and {section}.base_url (the API root, e.g. http://vllm:8000/v1)")

    def _body(self, text: str, max_tokens: int, want_logprobs: bool) -> dict:
        body = {"model": self.cfg.model, "max_tokens": max_tokens, "temperature": 0.0}
        if not want_logprobs:
            body["stop"] = [prompting.ANSWER_CUE.strip()]
        if self.cfg.api == "completions":
            body["prompt"] = text
            if want_logprobs:
                body["logprobs"] = self.cfg.top_logprobs
        else:
            body["messages"] = [{"role": "user", "content": text + (" Answer 1 or 2." if want_logprobs else "")}]
            if want_logprobs:
                body.update(logprobs=True, top_logprobs=self.cfg.top_logprobs)
        return body

    def _parse(self, data: dict) -> tuple[str, dict[str, float] | None]:
        try:
            choice = data["choices"][0]
            logprobs = choice.get("logprobs") or {}
            if self.cfg.api == "completions":
                tops = logprobs.get("top_logprobs") or []
                text, top = choice["text"], (tops[0] if tops else None)
            else:
                content = logprobs.get("content") or []
                top = {t["token"]: t["logprob"] for t in content[0].get("top_logprobs", [])} if content else None
                text = choice["message"]["content"] or ""
            return _checked(text, top)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise UserError(f"judge endpoint {self.url} returned an unexpected response (an OpenAI-compatible "
                            f"completion with numeric log-probs expected): {str(data)[:200]}") from None

    async def _request(self, session, text: str, max_tokens: int, want_logprobs: bool) -> tuple[str, dict | None]:
        return self._parse(await self.client.post(session, self.path, self._body(text, max_tokens, want_logprobs)))


# The whole answer is the choice: "1", "2.", "**2**", "Response 1", "Answer: 2"; "10", "2023" or "2 is worse than 1"
# are not (the first character alone read them as confident votes).
ANSWER = re.compile(r"(?:(?:answer|response)\s*[:#]?\s*)?[*\"'(\[]*([12])[*\"')\]]*[.!]?", re.IGNORECASE)
UNREADABLE_CHECKED_AFTER = 8  # answers: a judge that reads none of them as 1 or 2 is not judging
SHARE_CHECKED_AFTER = 50  # answers before their unreadable share is held to max_unreadable_fraction (1 in 8 is noise)
LOWEST_LOGPROB = -1e4  # servers write an impossible token's log-prob as -9999 (vLLM) or -inf: the same to a label


def _checked(text, top) -> tuple[str, dict[str, float] | None]:
    """The answer text and its top log-probs, as types a label can be computed from (ValueError, TypeError else)."""
    if not isinstance(text, str):
        raise TypeError("the answer is not text")
    if top is None:
        return text, None
    if not isinstance(top, dict) or not all(isinstance(token, str) for token in top):
        raise TypeError("top log-probs are not a token -> log-prob object")
    numbers = {}
    for token, value in top.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value > 1e-6:
            raise ValueError(f"log-prob {value!r} of {token!r} is not a log-probability")
        numbers[token] = max(float(value), LOWEST_LOGPROB)
    return text, numbers


def _log_sum_exp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
