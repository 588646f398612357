"""What runs inside one replica of a model service: the model and the two kinds of completion the stages ask for.

- Sampling (generate.backend endpoint): each prompt text sampled with the request's seed through the same function
  the in-process generate stage calls (`sample_texts`), so a served pair is the in-process pair whichever replica
  answers.
- Next-token log-probs (the hf judge, `max_tokens` 1 at temperature 0 with `logprobs`): one padded forward over the
  request's prompts, as the in-process judge runs its batch, and the log-softmax of the last position.
"""
from __future__ import annotations

import errno
import random
import threading
from dataclasses import dataclass, field, replace

import torch

from rlaif.config import PipelineConfig
from rlaif.errors import UserError
from rlaif.serving.identity import model_digest


@dataclass
class Request:
    """The subset of the OpenAI completions request a service honours (plus top_k, as vLLM accepts it)."""

    prompts: list  # texts, or token-id lists
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: each prompt sampled with its own random seed (as OpenAI and vLLM do)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    logprob_ids: list[int] = field(default_factory=list)  # next-token log-probs returned whatever their rank
    pad_to: int = 0  # left-pad every prompt to at least this many tokens, as the caller's in-process batch would

    @property
    def max_new_tokens(self) -> int:  # the name sample_texts reads
        return self.max_tokens

    def row_seeds(self) -> list[int]:
        """Each prompt's seed: the request's for all (the same prompt twice samples the same tokens, as a seeded
        vLLM request does), or without one a random seed per prompt (copies of a prompt are independent samples)."""
        if self.seed is not None:
            return [self.seed] * len(self.prompts)
        return [random.randrange(2**63) for _ in self.prompts]


class BadRequest(ValueError):
    """A request the service refuses with HTTP 400 (the message says why)."""

    status, code = 400, None


class UnknownModel(BadRequest):
    """A request for a model this service does not serve: HTTP 404, OpenAI's model_not_found."""

    status, code = 404, "model_not_found"


def check_against_model(request: Request, token_ids: list[list[int]], vocab_size: int, positions: int | None) -> None:
    """Token ids the model has, and prompt (padded) plus new tokens within its positions: past either the model
    indexes out of range (a 500 with a traceback) or, with rotary positions, returns text it was never trained on."""
    for what, ids in [*((f"prompt {number}", ids) for number, ids in enumerate(token_ids)),
                      ("logprob_token_ids", request.logprob_ids)]:
        if any(not 0 <= token < vocab_size for token in ids):
            raise BadRequest(f"{what} holds token ids outside the model's vocabulary (0..{vocab_size - 1})")
    if positions is None:
        return
    from rlaif.models.prompt_text import check_fits

    try:
        check_fits(None, max(request.pad_to, *map(len, token_ids)), request.max_tokens,
                   "a prompt (padding included)", "max_tokens", positions)
    except UserError as exc:
        raise BadRequest(str(exc)) from None


def cache_bytes_per_token(model) -> int | None:
    """Bytes of attention cache one token holds in `model` (keys and values in every layer, in the model's dtype);
    None where its config does not say (a state-space model has no such cache)."""
    config = model.config.get_text_config()
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    if not heads or not layers:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # GQA's key/value heads (Falcon names them num_kv_heads, and its multi-query layers keep one)
    kv_heads = (1 if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False)
                else getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads)
    return layers * 2 * kv_heads * head_dim * next(model.parameters()).element_size()


def check_cache_size(request: Request, token_ids: list[list[int]], bytes_per_token: int | None,
                     budget_gib: float) -> None:
    """A request is one batch: its attention cache (every prompt padded to the longest, plus max_tokens) must fit the
    replica's budget, or one request would take the replica, and every request in flight on it, out of memory."""
    if bytes_per_token is None:
        return
    tokens = len(token_ids) * (max(request.pad_to, *map(len, token_ids)) + request.max_tokens)
    needed = tokens * bytes_per_token / 2**30
    if needed > budget_gib:
        raise BadRequest(f"the request would hold {needed:.2f} GiB of attention cache ({len(token_ids)} prompts of "
                         f"{tokens // len(token_ids)} tokens with max_tokens), more than the {budget_gib:g} GiB a "
                         "request may (serve.max_request_cache_gib): send fewer prompts or fewer max_tokens per "
                         "request")


@dataclass
class Choice:
    text: str
    tokens: int
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None  # per generated token: token id -> log-prob
    prompt_tokens: int = 0


def pick_engine(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "transformers"
    return "vllm" if torch.cuda.is_available() else "transformers"


class TransformersEngine:
    name = "transformers"
    extensions = ("pad_to_tokens", "logprob_token_ids")  # rlaif's request fields it honours (/v1/models lists them)

    def __init__(self, cfg: PipelineConfig, model: str):
        from rlaif.distributed import local_device
        from rlaif.models.loading import load_causal_lm, load_policy, load_tokenizer, resolve, with_model_stops

        if model == "policy":
            self.tokenizer, self.model = load_policy(cfg.policy)
        else:
            check_served_model(cfg, model)
            path = resolve(cfg.label.hf.model, "judge model")
            self.tokenizer = with_model_stops(load_tokenizer(path, cfg.label.hf.trust_remote_code, padding_side="left"),
                                              path)  # a rationale ends where the in-process judge's does
            self.model = load_causal_lm(path, cfg.label.hf.trust_remote_code, "judge model").eval()
        self.device = local_device()
        self.model.to(self.device)
        self.cache_budget_gib, self.bytes_per_token = cfg.serve.max_request_cache_gib, cache_bytes_per_token(self.model)
        self.lock = threading.Lock()  # one request at a time per replica: replicas, not threads, add throughput

    def complete(self, request: Request) -> list[Choice]:
        from rlaif.models.prompt_text import position_limit

        token_ids = self._token_ids(request)
        check_against_model(request, token_ids, self.model.get_input_embeddings().num_embeddings,
                            position_limit(self.model))
        check_cache_size(request, token_ids, self.bytes_per_token, self.cache_budget_gib)
        with self.lock, torch.no_grad():
            if request.logprobs is not None and request.max_tokens == 1 and request.temperature == 0:
                choices = self._next_token(request, token_ids)
            else:
                choices = self._sample(request, token_ids)
        return [replace(choice, prompt_tokens=len(ids)) for choice, ids in zip(choices, token_ids)]

    def _token_ids(self, request: Request) -> list[list[int]]:
        return token_ids(self.tokenizer, request.prompts)

    def _batch(self, request: Request, ids: list[list[int]]) -> dict:
        """Left-padded input_ids and attention_mask: a row padded as in the caller's batch computes what it computes
        there (padding changes float rounding; the other rows of a batch do not)."""
        width = max(request.pad_to, *map(len, ids))
        enc = self.tokenizer.pad({"input_ids": ids}, padding="max_length", max_length=width, return_tensors="pt")
        return {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}

    def _next_token(self, request: Request, ids: list[list[int]]) -> list[Choice]:
        from rlaif.models.generation import next_token_logprobs

        logprobs = next_token_logprobs(self.model, self._batch(request, ids)).cpu()
        top = torch.topk(logprobs, min(request.logprobs or 1, logprobs.shape[-1]), dim=-1)
        asked = request.logprob_ids
        return [Choice(self.tokenizer.decode([int(ids[0])]), 1, "length",
                       [dict(zip(ids.tolist(), values.tolist())) | dict(zip(asked, row[asked].tolist()))])
                for ids, values, row in zip(top.indices, top.values, logprobs)]

    def _sample(self, request: Request, ids: list[list[int]]) -> list[Choice]:
        from rlaif.models.generation import sample_encoded

        results = sample_encoded(self.model, self.tokenizer, self._batch(request, ids), request.row_seeds(), request)
        return [Choice(text, n, "length" if n >= request.max_tokens else "stop") for text, n in results]


class VLLMEngine:
    """vLLM on a GPU: continuous batching across requests, per-request seeds (the same tokens whichever replica
    answers; not the transformers engine's tokens: different kernels)."""

    name = "vllm"
    extensions = ()

    def __init__(self, cfg: PipelineConfig, model: str):
        try:
            from vllm import LLM
        except ImportError:
            raise UserError("serve.engine vllm needs vLLM on a GPU machine: pip install 'rlaif[vllm]'") from None
        from rlaif.models.loading import resolve, resolve_policy

        path = resolve_policy(cfg.policy) if model == "policy" else resolve(cfg.label.hf.model, "judge model")
        trust = cfg.policy.trust_remote_code if model == "policy" else cfg.label.hf.trust_remote_code
        self.llm = LLM(model=str(path), seed=cfg.seed, trust_remote_code=trust)
        self.tokenizer = self.llm.get_tokenizer()

    def complete(self, request: Request) -> list[Choice]:
        if request.logprob_ids:  # vLLM returns the top-k only: a bound where exact log-probs were asked for
            raise BadRequest("logprob_token_ids is not served by the vllm engine: serve with serve.engine=transformers")
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=1, seed=seed, temperature=request.temperature, top_p=request.top_p,
                                 top_k=request.top_k or -1, max_tokens=request.max_tokens, stop=request.stop or None,
                                 logprobs=request.logprobs) for seed in request.row_seeds()]
        ids = token_ids(self.tokenizer, request.prompts)
        prompts = [TokensPrompt(prompt_token_ids=row) for row in ids]
        choices = []
        for out, row in zip(self.llm.generate(prompts, params, use_tqdm=False), ids):
            sample = out.outputs[0]
            top = ([{tid: lp.logprob for tid, lp in step.items()} for step in sample.logprobs]
                   if request.logprobs is not None else None)
            choices.append(Choice(sample.text.strip(), len(sample.token_ids), sample.finish_reason or "stop", top,
                                  len(row)))
        return choices


def token_ids(tokenizer, prompts: list) -> list[list[int]]:
    """A request's prompts as ids: ids as sent, text as the pipeline encodes a prompt (BOS where the model's tokenizer
    starts with one), on both engines alike."""
    from rlaif.models.prompt_text import prompt_token_ids

    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(prompt_token_ids(tokenizer, texts))
    return [next(encoded) if isinstance(p, str) else p for p in prompts]


def make_engine(cfg: PipelineConfig, model: str):
    """The engine of one replica, with what a client checks before trusting it: engine name and model digest."""
    engine = (VLLMEngine if pick_engine(cfg.serve.engine) == "vllm" else TransformersEngine)(cfg, model)
    engine.model_digest = model_digest(cfg, model)
    engine.role = model
    return engine


def check_served_model(cfg, model: str) -> None:
    """Before serving or rendering a service's manifests: the judge is served from label.hf.model."""
    if model == "judge" and not cfg.label.hf.model:
        raise UserError("serving the judge needs label.hf.model (a Hugging Face causal-LM directory)")


def check_bindable(host: str, port: int) -> None:
    """Can this process listen on host:port? Checked before the service says it is serving (uvicorn would print
    its own error after that and exit 3)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise UserError(f"serve.host={host!r} is not an address this machine can listen on: use 0.0.0.0, "
                        "127.0.0.1 or one of its own addresses") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as error:
            fix = {errno.EADDRNOTAVAIL: f"serve.host={host} is not an address of this machine: use 0.0.0.0, "
                                        "127.0.0.1 or one of its own addresses",
                   **({errno.EACCES: "ports below 1024 need privileges: pick a serve.port of 1024 or more"}
                      if port < 1024 else {})}
            raise UserError(f"cannot listen on {host}:{port} ({error.strerror}): "
                            f"{fix.get(error.errno, 'pick another serve.port or stop what holds it')}") from None
