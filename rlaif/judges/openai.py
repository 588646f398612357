"""OpenAI-compatible endpoint judge (vLLM, TGI, llama.cpp server, a hosted API).

The same prompts as the hf judge, sent through rlaif.serving.client (bounded concurrency, a timeout per request,
retries with backoff on timeouts, connection errors, 429 and 5xx). The label is the
softmax over the answer tokens' log-probs when the server returns them, else the parsed answer (1 -> 1.0, 2 -> 0.0,
anything else 0.5, counted). The API key comes from the environment variable that the config names.
"""
from __future__ import annotations

import math

import torch

from rlaif.errors import UserError
from rlaif.judges import prompting
from rlaif.serving.client import ServiceClient


class OpenAIJudge:
    def __init__(self, settings):
        o = settings.openai
        if not o.base_url or not o.model:
            raise UserError("judge 'openai' needs label.openai.base_url (e.g. http://vllm:8000/v1) "
                            "and label.openai.model")
        self.settings, self.cfg = settings, o
        self.client = ServiceClient(o, "label.openai")
        self.path = "/completions" if o.api == "completions" else "/chat/completions"
        self.url = self.client.base_url + self.path
        self.name = f"openai:{o.model}"
        self.examples = prompting.load_few_shot(settings.few_shot)
        # the client's request and retry counts, and how each answer was read
        self.stats = self.client.stats
        self.stats.update(answers_from_logprobs=0, answers_parsed=0, answers_unreadable=0)

    def prefer_first(self, prompts, first, second, principles) -> torch.Tensor:
        s = self.settings
        texts = [prompting.pairwise_prompt(s.preamble, pr, self.examples, p, a, b, s.chain_of_thought)
                 for p, a, b, pr in zip(prompts, first, second, principles)]
        return torch.tensor(self.client.map(self._judge_one, texts), dtype=torch.float32)

    async def _judge_one(self, session, text: str) -> float:
        if self.settings.chain_of_thought:
            rationale, _ = await self._request(session, text, self.settings.rationale_tokens, want_logprobs=False)
            text = prompting.after_rationale(text, rationale)
        answer, top = await self._request(session, text, 1, want_logprobs=True)
        return self._p_first(answer, top)

    def _p_first(self, answer: str, top: dict[str, float] | None) -> float:
        if top:
            lp = {a: [v for tok, v in top.items() if tok.strip() == a] for a in ("1", "2")}
            if lp["1"] or lp["2"]:
                floor = min(top.values())  # an answer outside the top-k is at most as likely as the least likely shown
                l1, l2 = (math.log(sum(math.exp(v) for v in lp[a])) if lp[a] else floor for a in ("1", "2"))
                self.stats["answers_from_logprobs"] += 1
                return 1.0 / (1.0 + math.exp(l2 - l1))
        answer = answer.strip()
        if answer[:1] in ("1", "2"):
            self.stats["answers_parsed"] += 1
            return 1.0 if answer[0] == "1" else 0.0
        self.stats["answers_unreadable"] += 1
        return 0.5

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
                return choice["text"], (tops[0] if tops else None)
            content = logprobs.get("content") or []
            top = {t["token"]: t["logprob"] for t in content[0].get("top_logprobs", [])} if content else None
            return choice["message"]["content"] or "", top
        except (KeyError, IndexError, TypeError, AttributeError):
            raise UserError(f"judge endpoint {self.url} returned an unexpected response: {str(data)[:200]}") from None

    async def _request(self, session, text: str, max_tokens: int, want_logprobs: bool) -> tuple[str, dict | None]:
        return self._parse(await self.client.post(session, self.path, self._body(text, max_tokens, want_logprobs)))
