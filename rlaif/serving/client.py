"""Calling an OpenAI-compatible service from a stage: bounded concurrency, a timeout per request, and retries with
exponential backoff (or the server's Retry-After) on timeouts, connection errors, 429, 500, 502, 503 and 504, so a
replica that dies mid-request, or a service that scales, costs a retry and never a result."""
from __future__ import annotations

import asyncio
import json
import math
import os
import random

from rlaif.errors import UserError, keep_secret, redact

RETRYABLE = {429, 500, 502, 503, 504}
MAX_RESPONSE_BYTES = 64 * 2**20  # far above any completion; a server streaming more is not answering the request
MAX_BACKOFF_S = 600.0


async def read_body(stream, limit: int) -> bytes:
    """A response body to its end, or its first `limit` bytes: a stream's read(n) returns what has arrived so far,
    the first network packet of a body sent in several."""
    chunks, size = [], 0
    while size < limit and (chunk := await stream.read(limit - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class ServiceClient:
    """`settings` has base_url, api_key_env, concurrency, timeout_s, max_retries, backoff_s (a ServiceEndpoint or the
    openai judge's section); `section` names them in errors (e.g. `generate.endpoint`)."""

    def __init__(self, settings, section: str):
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise UserError("calling a model service needs aiohttp: pip install aiohttp") from None
        self.settings, self.section = settings, section
        self.base_url = settings.base_url.rstrip("/")
        self.stats = {"requests": 0, "retries": 0}

    def headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key_env and (key := os.environ.get(self.settings.api_key_env)):
            keep_secret(key)  # a server may echo it back in an error body, which an error line quotes
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def get(self, path: str) -> dict:
        """One GET (e.g. /models), for checks before any work; a clear error when the service is not there."""
        status, body = self._ask(path)
        try:
            if status >= 400:
                raise ValueError(f"HTTP {status}")
            return json.loads(body)
        except ValueError as exc:  # json's errors are ValueErrors
            raise UserError(f"the service at {redact(self.base_url + path)} did not answer as a model service ({exc}): "
                            f"check {self.section}.base_url") from None

    def check_answers(self) -> tuple[bool, list[str] | None]:
        """Before any work: a service that is there (refused or unresolvable: not) takes our key and speaks JSON.
        What the stage's requests wait out or retry passes: silence (a service scaled to zero, warming up), 429,
        500, 502, 503 and 504; so does a service without /models (404, 405): the first request will tell. Returns
        (whether it answered, the model ids its /models lists or None)."""
        from rlaif.io.endpoint import MAX_BODY_BYTES

        answer = self._ask("/models", silence_ok=True)
        if answer is None:
            return False, None
        (status, body), url = answer, redact(self.base_url + "/models")
        if status in (401, 403):
            raise UserError(f"{url} refused the request with HTTP {status}: check the API key ({self.key_named()}) "
                            f"and {self.section}.base_url")
        if status != 200 or len(body) >= MAX_BODY_BYTES:  # a longer model list was cut off: not judged
            return True, None
        try:
            listed = json.loads(body)
        except ValueError:
            raise self._not_json(url, body) from None
        entries = listed.get("data") if isinstance(listed, dict) else None
        return True, ([entry["id"] for entry in entries if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
                      if isinstance(entries, list) else None)

    def key_named(self) -> str:
        """The API key as an error line names it: its variable, or that none is sent."""
        return f"${self.settings.api_key_env}" if self.settings.api_key_env else "no key (api_key_env is empty)"

    def ask_once(self, path: str, body: dict) -> tuple[int, bytes] | None:
        """One bounded POST, not retried, for checks before any work: (status, body), or None where the service is
        silent (warming up: the stage's requests wait)."""
        return self._ask(path, body, silence_ok=True)

    def _ask(self, path: str, body: dict | None = None, silence_ok: bool = False) -> tuple[int, bytes] | None:
        """One bounded GET (a POST of `body` if given), direct (as the stage's aiohttp client goes: it ignores
        $HTTP_PROXY); None where the service is silent and `silence_ok`."""
        from rlaif.io import endpoint as http

        url, timeout_s = self.base_url + path, min(self.settings.timeout_s, 30.0)
        try:
            if body is None:
                return http.get(http.without_credentials(url), timeout_s, self.headers(), proxies=False)
            return http.post_json(http.without_credentials(url), body, timeout_s, self.headers(), proxies=False)
        except http.NoAnswer as why:
            if silence_ok and why.silent:
                return None
            raise UserError(f"the service at {redact(url)} {why}: start it or fix {self.section}.base_url") from None

    def post_all(self, path: str, bodies: list[dict]) -> list[dict]:
        """POST every body (at most `concurrency` in flight); the responses in the order of `bodies`."""
        return self.map(lambda session, body: self.post(session, path, body), bodies)

    def map(self, work, items: list) -> list:
        """`await work(session, item)` for every item, at most `concurrency` at once; results in order."""
        return asyncio.run(self._map(work, items))

    async def _map(self, work, items: list) -> list:
        import aiohttp

        limit = asyncio.Semaphore(self.settings.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        async with aiohttp.ClientSession(headers=self.headers(), timeout=timeout) as session:
            async def one(item):
                async with limit:
                    return await work(session, item)
            tasks = [asyncio.ensure_future(one(item)) for item in items]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:  # the first failure cancels the rest: no request once one has stopped the stage
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    def completions(self, bodies: list[dict]) -> list[dict]:
        """POST /completions once per body; each answer checked to hold a first choice with its text (an answer
        without one is a server that is not an OpenAI-compatible completions API, or a broken one: one line)."""
        answers = self.post_all("/completions", bodies)
        for answer in answers:
            choices = answer.get("choices") if isinstance(answer, dict) else None
            choice = choices[0] if isinstance(choices, list) and choices else None
            if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
                raise UserError(f"{redact(self.base_url)}/completions answered without a completion's text "
                                f"({str(answer)[:120]}): check that {self.section}.base_url is an OpenAI-compatible "
                                "completions API")
        return answers

    async def post(self, session, path: str, body: dict) -> dict:
        import aiohttp

        url = self.base_url + path
        for attempt in range(self.settings.max_retries + 1):
            self.stats["requests"] += 1
            retry_after = None
            try:
                async with session.post(url, json=body) as resp:
                    if resp.status == 200:
                        return self.json_body(url, await read_body(resp.content, MAX_RESPONSE_BYTES + 1))
                    if resp.status not in RETRYABLE:
                        key = (f" and the API key in ${self.settings.api_key_env}" if self.settings.api_key_env
                               else "")
                        raise UserError(f"{url} refused the request with HTTP {resp.status}: "
                                        f"{(await resp.text())[:200]!r} (check {self.section}{key})")
                    error, retry_after = f"HTTP {resp.status}", resp.headers.get("Retry-After")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: not JSON, UTF-8
                error = type(exc).__name__
            if attempt == self.settings.max_retries:
                raise self._gave_up(url, attempt + 1, error)
            self.stats["retries"] += 1
            await asyncio.sleep(self._delay(attempt, retry_after))
        raise AssertionError("the loop returns or raises")

    def json_body(self, url: str, data: bytes):
        """A 200's body; one that is not JSON (an HTML page at a URL short of the API root) is no hiccup to retry."""
        if len(data) > MAX_RESPONSE_BYTES:
            raise UserError(f"{url} answered with more than {MAX_RESPONSE_BYTES >> 20} MiB: is it an OpenAI-compatible "
                            "service?")
        try:
            return json.loads(data)
        except ValueError:
            raise self._not_json(url, data) from None

    def _not_json(self, url: str, body: bytes) -> UserError:
        return UserError(f"{url} answered with something other than JSON ({body[:60]!r}): set {self.section}.base_url "
                         "to the API root of an OpenAI-compatible service, e.g. http://vllm:8000/v1")

    def _gave_up(self, url: str, tries: int, error: str) -> UserError:
        slow = (f"raise {self.section}.timeout_s (now {self.settings.timeout_s:g} s) for a service that answers "
                "slowly, or " if error == "TimeoutError" else "")
        return UserError(f"{url} failed {'once' if tries == 1 else f'{tries} times'} (last: {error}): check that the "
                         f"service is up and {self.section}.base_url, {slow}raise {self.section}.max_retries")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        try:
            wait = float(retry_after) if retry_after else math.nan
        except ValueError:  # an HTTP date, or garbage: our own backoff
            wait = math.nan
        if math.isfinite(wait) and wait >= 0:  # asyncio.sleep(nan) wakes at no defined time
            return min(wait, 60.0)
        return min(self.settings.backoff_s * 2**attempt, MAX_BACKOFF_S) * (0.5 + random.random())
