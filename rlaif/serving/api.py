"""The HTTP face of a model service: OpenAI's /v1/completions (the subset the stages use, plus vLLM's top_k) and
/v1/models, which also names the engine and the model digest a client checks. The Ray Serve deployment and the plain
one-process server (`plain_app`) both answer through these functions."""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from rlaif.config.base import MIN_TEMPERATURE, encodable, yes_no_for_a_number
from rlaif.io import user_files
from rlaif.serving.engine import BadRequest, Choice, Request, UnknownModel

# Above any request the stages send: a prompt of data.max_prompt_chars (at most 1,000,000) characters, each escaped
# to at most 12 bytes in JSON, and judge prompts of token ids.
MAX_REQUEST_BYTES = 16 * 2**20
MAX_STOP_STRINGS = 256  # each is searched for in every completion at every step
REPLICA_HEADER = "x-rlaif-replica"  # the answering replica's process id: which replica served a request


class CompletionBody(BaseModel):
    """Unknown OpenAI fields (user, frequency_penalty at 0, ...) are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # "4" is not a number of tokens
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0, le=100)
    """Below 1e-5, greedy (as vLLM serves it): dividing logits by it would overflow."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    n: int = Field(1, ge=1, le=1)
    logprob_token_ids: list[int] = Field([], max_length=64)
    """rlaif's extension: with `logprobs`, these token ids' exact next-token log-probs are returned among the top ones
    (a judge reads its answers' own log-probs, not a bound from the top-k; other servers ignore it)."""
    pad_to_tokens: int = Field(0, ge=0, le=1_000_000)
    """rlaif's extension: left-pad each prompt to this many tokens, as the caller's in-process batch pads it, so a
    served result is bit-for-bit the in-process one (other servers ignore it)."""
    echo: bool = False
    stream: bool = False
    model: str | None = None
    """Checked against the served name where given (an openai judge pointed at a policy service got its samples)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value, info: ValidationInfo):
        if yes_no_for_a_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError("is a yes/no value where a number is expected")
        return value


def parse_request(body: dict) -> Request:
    if _booleans_in(body.get("prompt") if isinstance(body, dict) else None):  # pydantic would read them as 1 and 0
        raise BadRequest("prompt holds true/false where token ids are expected")
    try:
        parsed = CompletionBody.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise BadRequest(f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}") from None
    if parsed.echo or parsed.stream:
        raise BadRequest("echo and stream are not served: send echo=false, stream=false")
    prompts = parsed.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise BadRequest("prompt is empty")
    for number, prompt in enumerate(prompts):
        if not prompt:
            raise BadRequest(f"prompt {number} is empty")

        if isinstance(prompt, str) and not encodable(prompt):
            raise BadRequest(f"prompt {number} holds a lone surrogate (an unpaired \\ud800-\\udfff escape)")
    temperature = parsed.temperature if parsed.temperature >= MIN_TEMPERATURE else 0.0
    if parsed.logprobs is not None and not (parsed.max_tokens == 1 and temperature == 0):
        raise BadRequest("logprobs are served for next-token scoring only: max_tokens 1 at temperature 0")
    if parsed.logprob_token_ids and parsed.logprobs is None:
        raise BadRequest("logprob_token_ids needs logprobs (next-token scoring): send logprobs with it")
    stop = [parsed.stop] if isinstance(parsed.stop, str) else list(parsed.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop holds {len(stop)} strings, more than the {MAX_STOP_STRINGS} a request may give")
    if "" in stop:
        raise BadRequest("stop holds an empty string, which would end every completion at once: remove it")
    if not all(map(encodable, stop)):
        raise BadRequest("stop holds a lone surrogate (an unpaired \\ud800-\\udfff escape)")
    return Request(prompts=list(prompts), max_tokens=parsed.max_tokens, temperature=temperature,
                   top_p=parsed.top_p, top_k=max(parsed.top_k, 0), seed=parsed.seed, stop=stop,
                   logprobs=parsed.logprobs, logprob_ids=parsed.logprob_token_ids, pad_to=parsed.pad_to_tokens)


def _booleans_in(prompt) -> bool:
    rows = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    return any(isinstance(row, list) and any(isinstance(token, bool) for token in row) for row in rows)


def _logprobs(engine, choice: Choice) -> dict | None:
    if choice.top_logprobs is None:
        return None
    tops = [sorted(step.items(), key=lambda kv: -kv[1]) for step in choice.top_logprobs]
    return {"tokens": [choice.text], "token_logprobs": [tops[0][0][1]], "text_offset": [0],
            "top_logprobs": [{engine.tokenizer.decode([tid]): lp for tid, lp in step} for step in tops],
            "top_token_ids": [[[tid, lp] for tid, lp in step] for step in tops]}  # exact ids: strings may collide


async def completion_response(engine, name: str, request):
    """The HTTP response to a completions request, in both apps: the completion, or a 400 in OpenAI's error format
    for a body too large, not a JSON object (FastAPI's own check would answer 422 in its own format) or a request the
    service refuses."""
    from fastapi.responses import JSONResponse

    try:
        raw = await body_within_limit(request)
        try:
            body = json.loads(raw, object_pairs_hook=user_files.unique_keys)
        except user_files.DuplicateKey as exc:  # which of its values would be meant is a guess
            raise BadRequest(f"the body gives the key {exc.args[0]!r} twice in one object: send it once") from None
        except (ValueError, RecursionError):  # not JSON or UTF-8, a number past Python's digit limit, deep nesting
            raise BadRequest("the body is not JSON: send a JSON object of completion parameters") from None
        if not isinstance(body, dict):
            raise BadRequest("the body is not a JSON object of completion parameters")
        return JSONResponse(await complete(engine, name, body), headers=replica_headers())
    except BadRequest as exc:
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "code": exc.code}},
                            status_code=exc.status)


async def body_within_limit(request) -> bytes:
    """The request's body, refused past MAX_REQUEST_BYTES (one oversized request held the replica for a minute while
    the prompt was tokenized, and every client behind it): before it is read where its length is declared, else as
    soon as the chunks read pass the limit (a chunked body of any size was read whole into memory first)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise BadRequest(f"the body is {int(declared) / 2**20:.1f} MiB, more than the {MAX_REQUEST_BYTES >> 20} MiB a "
                         "completions request may be: send fewer or shorter prompts per request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise BadRequest(f"the body is more than the {MAX_REQUEST_BYTES >> 20} MiB a completions request may be: "
                             "send fewer or shorter prompts per request")
        chunks.append(chunk)
    return b"".join(chunks)


async def complete(engine, name: str, body: dict) -> dict:
    """The completions response for `body` (raises BadRequest); the engine runs in a worker thread."""
    request = parse_request(body)
    if body.get("model") not in (None, name):
        raise UnknownModel(f"the model {str(body['model'])[:100]!r} is not served here: this service serves {name!r} "
                           "(send that name, or none)")
    choices = await asyncio.to_thread(engine.complete, request)
    prompt_tokens, completion_tokens = sum(c.prompt_tokens for c in choices), sum(c.tokens for c in choices)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name,
            "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": _logprobs(engine, c)}
                        for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def models(engine, name: str) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlaif",
                                        "rlaif": {"engine": engine.name, "model_digest": engine.model_digest,
                                                  "role": engine.role,
                                                  "extensions": list(engine.extensions)}}]}


def replica_headers() -> dict:
    return {REPLICA_HEADER: str(os.getpid())}


def plain_app(engine, name: str, route_prefix: str = "/"):
    """One replica in this process, without Ray (the Kubernetes Deployment's pods, behind a Service and an HPA); its
    API at <route_prefix>/v1, as Ray Serve mounts it, and /healthz at the root for the pods' probes."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.requests import Request as StarletteRequest

    app = FastAPI(title=f"rlaif {name}")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    api_root = route_prefix.rstrip("/") + "/v1"

    @app.get(f"{api_root}/models")
    async def list_models():
        return JSONResponse(models(engine, name), headers=replica_headers())

    async def completions(request):
        return await completion_response(engine, name, request)

    # The raw request, not a `dict` body FastAPI would check (and answer 422 in its own format); the annotation is
    # set here, where fastapi is imported, not as a string FastAPI would resolve in this module's globals.
    completions.__annotations__ = {"request": StarletteRequest}
    app.post(f"{api_root}/completions")(completions)

    return app
