"""OpenAI-compatible endpoint judge (vLLM, TGI, llama.cpp server, a hosted API).

The same prompts as the hf judge, sent with bounded concurrency; each request has a timeout and is retried with
exponential backoff (and the server's Retry-After) on timeouts, connection errors, 429 and 5xx. The label is the
softmax over the answer tokens' log-probs when the server returns them, else the parsed answer (1 -> 1.0, 2 -> 0.0,
anything else 0.5, counted). The API key comes from the environment variable that the config names.
"""
from __future__ import annotations

import asyncio
import math
import os
import random

import torch

from rlaif.errors import UserError
from rlaif.judges import prompting

RETRYABLE = {429, 500, 502, 503, 504}


class OpenAIJudge:
    def __init__(self, settings):
        o = settings.openai
        if not o.base_url or not o.model:
            raise UserError("judge 'openai' needs label.openai.base_url (e.g. http://vllm:8000/v1) "
                            "and label.openai.model")
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise UserError("judge 'openai' needs aiohttp: pip install aiohttp") from None
        self.settings, self.cfg = settings, o
        self.url = o.base_url.rstrip("/") + ("/completions" if o.api == "completions" else "/chat/completions")
        self.name = f"openai:{o.model}"
        self.examples = prompting.load_few_shot(settings.few_shot)
        self.stats = {"requests": 0, "retries": 0, "answers_from_logprobs": 0, "answers_parsed": 0,
                      "answers_unreadable": 0}

    def prefer_first(self, prompts, first, second, principles) -> torch.Tensor:
        s = self.settings
        texts = [prompting.pairwise_prompt(s.preamble, pr, self.examples, p, a, b, s.chain_of_thought)
                 for p, a, b, pr in zip(prompts, first, second, principles)]
        return torch.tensor(asyncio.run(self._judge_all(texts)), dtype=torch.float32)

    async def _judge_all(self, texts: list[str]) -> list[float]:
        import aiohttp

        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env and (key := os.environ.get(self.cfg.api_key_env)):
            headers["Authorization"] = f"Bearer {key}"
        limit = asyncio.Semaphore(self.cfg.concurrency)
        async with aiohttp.ClientSession(headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s)) as session:
            return list(await asyncio.gather(*(self._judge_one(session, limit, t) for t in texts)))

    async def _judge_one(self, session, limit, text: str) -> float:
        async with limit:
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
        import aiohttp

        body = self._body(text, max_tokens, want_logprobs)
        for attempt in range(self.cfg.max_retries + 1):
            self.stats["requests"] += 1
            retry_after = None
            try:
                async with session.post(self.url, json=body) as resp:
                    if resp.status == 200:
                        return self._parse(await resp.json(content_type=None))
                    if resp.status not in RETRYABLE:
                        raise UserError(f"judge endpoint {self.url} refused the request with HTTP {resp.status}: "
                                        f"{(await resp.text())[:200]!r} (check label.openai.model and the API key in "
                                        f"${self.cfg.api_key_env})")
                    error = f"HTTP {resp.status}"
                    retry_after = resp.headers.get("Retry-After")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = type(exc).__name__
            if attempt == self.cfg.max_retries:
                raise UserError(f"judge endpoint {self.url} failed {attempt + 1} times (last: {error}): check that the "
                                "server is up and label.openai.base_url, or raise label.openai.max_retries")
            self.stats["retries"] += 1
            try:
                delay = (min(float(retry_after), 60.0) if retry_after
                         else self.cfg.backoff_s * 2**attempt * (0.5 + random.random()))
            except ValueError:
                delay = self.cfg.backoff_s * 2**attempt
            await asyncio.sleep(delay)
        raise AssertionError("the loop returns or raises")
