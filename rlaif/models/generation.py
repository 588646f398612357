"""Sampling and log-probs for causal LMs with left-padded prompts and right-padded responses."""
from __future__ import annotations

import contextlib

import torch

from rlaif.algo.logprobs import chosen_logprobs
from rlaif.config.loading import switch
from rlaif.errors import UserError
from rlaif.models.adapters import unwrapped
from rlaif.models.decode import decode_static, forward_takes, is_end, supports_static_decode
from rlaif.models.loading import STOP_IDS
from rlaif.models.packing import packs, response_states
from rlaif.models.prompt_text import check_fits, prompt_token_ids


def encode_prompts(tokenizer, texts: list[str], device) -> dict:
    """Left-padded input_ids and attention_mask of the formatted prompts (prompt_token_ids)."""
    enc = tokenizer.pad({"input_ids": prompt_token_ids(tokenizer, texts)}, padding=True, return_tensors="pt")
    return {k: enc[k].to(device) for k in ("input_ids", "attention_mask")}


def static_decoder_applies(model, enc: dict, decoder: str, stop=()) -> bool:
    """`auto`: $RLAIF_DECODER when set, else the static decoder for models it supports and no stop strings (on CPUs
    too, without the CUDA graph: faster than generate() there, BENCHMARKS.md); `static` or `generate`
    force one."""
    if decoder == "auto":
        decoder = switch("RLAIF_DECODER")
    if decoder == "static" and not supports_static_decode(model):
        raise UserError("the static decoder cannot run this model (sliding-window or ALiBi attention, DeepSpeed ZeRO-3 "
                        "shards or no full-graph support in transformers): set RLAIF_DECODER=auto or generate")
    if decoder != "auto":
        return decoder == "static"
    return not stop and supports_static_decode(model)


@torch.no_grad()
def sample(model, tokenizer, enc: dict, *, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
           num_return_sequences: int = 1, seed: int | None = None, min_new_tokens: int = 0,
           decoder: str = "auto", want_hidden: bool = False):
    """Response token ids [batch * n, <= max_new_tokens] (KV cache on); rows are padded after their EOS, a prompt's
    n samples are adjacent. bf16 autocast on GPUs (never on CPUs, where bf16 matmuls are slow). min_new_tokens bars
    EOS before that many tokens (= max_new_tokens: fixed-length responses). want_hidden (models with a plain head):
    (ids, the backbone's last hidden state that predicted each token [batch * n, >= T, H]; no CUDA graph then)."""
    check_fits(model, enc["input_ids"].shape[1], max_new_tokens)
    if seed is not None:
        torch.manual_seed(seed)
    recorder = LastHiddenRecorder(model) if want_hidden else None
    hooked = recorder if recorder is not None else contextlib.nullcontext()
    if static_decoder_applies(model, enc, decoder):
        seeds = torch.randint(0, 2**62, (enc["input_ids"].shape[0] * num_return_sequences,)).tolist()
        repeated = {k: v.repeat_interleave(num_return_sequences, 0) for k, v in enc.items()}
        with hooked:  # a captured graph would not run the recorder's hook: eager steps when it is on
            responses = decode_static(model, repeated, seeds, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_k=top_k, top_p=top_p, eos_ids=stop_ids(tokenizer),
                                      pad_id=tokenizer.pad_token_id, min_new_tokens=min_new_tokens,
                                      cuda_graph=False if want_hidden else None, recorder=recorder)
        return (responses, recorder.hidden()) if want_hidden else responses
    on_gpu = enc["input_ids"].is_cuda
    with hooked, plain_generation(model), torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
        out = model.generate(
            **enc,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p,
            top_k=top_k or None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_return_sequences,
            min_new_tokens=min_new_tokens or None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=stop_ids(tokenizer) or None,
            use_cache=True,
        )
    responses = out[:, enc["input_ids"].shape[1]:]
    return (responses, recorder.hidden()) if want_hidden else responses


class LastHiddenRecorder:
    """Keeps, for each forward generate() makes, the backbone's last hidden state at the last position: the state
    the next token was sampled from (the prefill's for the first token, each decode step's after). [batch, H] per
    token, never the full-vocabulary logits (a copy: a view would keep the prefill's whole [batch, prompt, H])."""

    def __init__(self, model):
        parts = backbone_and_head(model)
        if parts is None:
            raise ValueError("hidden states from sampling need a model whose logits are a plain head")
        self.backbone, self.steps, self.handle = parts[0], [], None

    def __enter__(self):
        self.handle = self.backbone.register_forward_hook(lambda _m, _i, out: self.keep(out[0]))
        return self

    def keep(self, hidden: torch.Tensor) -> None:
        """A forward's backbone output [batch, T, H]: its last position's state (the lean decode step calls this
        itself, not through the hook)."""
        self.steps.append(hidden[:, -1].clone())

    def __exit__(self, *exc):
        self.handle.remove()

    def spread_last(self, rows: torch.Tensor) -> None:
        """The last forward ran each of several rows' shared prompt once (the static decoder's prefill): row i's
        state is its rows[i]."""
        self.steps[-1] = self.steps[-1].index_select(0, rows)

    def hidden(self) -> torch.Tensor:
        return torch.stack(self.steps, 1)


class PerRowSampler:
    """Sampling with one random stream per row, as a logits processor for greedy decoding (Gumbel-max: the argmax of
    logits / T + Gumbel noise is a sample from softmax(logits / T), after top-k/top-p filtering). A row's tokens depend
    only on its own seed, not on which other rows share its batch: any sample can be regenerated alone, and batching,
    bucketing and sharding do not change what is sampled."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
        from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

        # CPU generators on every device, copied over once per decode step: a GPU run draws the same noise as a CPU
        # run (per-row CUDA generators were no faster on an H100: BENCHMARKS.md, On a GPU).
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.filters = LogitsProcessorList(
            ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.filters(input_ids, scores.float() / self.temperature)
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators]).to(scores.device)
        return scores - torch.log(-torch.log(uniform.clamp(min=1e-12)))


@torch.no_grad()
def sample_seeded(model, tokenizer, enc: dict, seeds: list[int], *, max_new_tokens: int, temperature: float,
                  top_p: float = 1.0, top_k: int = 0, stop: list[str] = (), min_new_tokens: int = 0,
                  decoder: str = "auto") -> torch.Tensor:
    """Response token ids [batch, <= max_new_tokens], row i sampled from its own seeds[i]; temperature 0 is greedy.
    Stops at EOS (not before min_new_tokens) or, when given, a stop string. On a GPU the static decoder
    (rlaif.models.decode) draws the per-row randomness on the device; elsewhere PerRowSampler does, on the CPU."""
    from transformers import LogitsProcessorList

    check_fits(model, enc["input_ids"].shape[1], max_new_tokens)
    if static_decoder_applies(model, enc, decoder, stop):
        return decode_static(model, enc, seeds, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, eos_ids=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id,
                             min_new_tokens=min_new_tokens)
    processors = LogitsProcessorList([PerRowSampler(seeds, temperature, top_k, top_p)]
                                     if temperature > 0 else [])
    with plain_generation(model), torch.autocast("cuda", dtype=torch.bfloat16, enabled=enc["input_ids"].is_cuda):
        out = model.generate(**enc, do_sample=False, logits_processor=processors, max_new_tokens=max_new_tokens,
                             min_new_tokens=min_new_tokens or None,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids(tokenizer) or None,
                             use_cache=True,
                             **({"stop_strings": list(stop), "tokenizer": tokenizer} if stop else {}))
    return out[:, enc["input_ids"].shape[1]:]


TOKEN_SETTINGS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@contextlib.contextmanager
def plain_generation(model):
    """generate() with the settings of its call alone. transformers fills every setting the call leaves unset from the
    model's generation_config.json, which may carry processors (repetition_penalty, suppress_tokens, top_k,
    no_repeat_ngram_size, min_p, ...): they would sample from another distribution than softmax(logits / T) under the
    configured top-k and top-p, the one whose log-probs, KL and entropy PPO and evaluate compute and the one the
    static decoder samples. The model's own config is back after the call (an exported policy keeps it); its EOS ids
    are read apart (loading.with_model_stops). Entries that are not transformers' settings stay (a model of its own
    code may read them in its generate). One generate at a time per model object: the serving engine holds a lock,
    and the asynchronous rollout samples with its own copy."""
    from transformers import GenerationConfig

    inner = unwrapped(model)
    own = inner.generation_config
    standard = GenerationConfig().to_dict()
    custom = {key: value for key, value in own.to_dict().items() if key not in standard and not key.startswith("_")}
    inner.generation_config = GenerationConfig(**{name: getattr(own, name, None) for name in TOKEN_SETTINGS},
                                               **custom)
    try:
        yield
    finally:
        inner.generation_config = own


def sample_texts(model, tokenizer, texts: list[str], seeds: list[int], device, settings) -> list[tuple[str, int]]:
    """(response text, response tokens) per (formatted prompt, seed): `settings` holds max_new_tokens, temperature,
    top_p, top_k and stop (generate's section, or a service request). In-process generation and the model service
    both call this, so a served sample is the in-process one."""
    return sample_encoded(model, tokenizer, encode_prompts(tokenizer, texts, device), seeds, settings)


def sample_encoded(model, tokenizer, enc: dict, seeds: list[int], settings) -> list[tuple[str, int]]:
    """sample_texts for prompts already encoded (left-padded input_ids and attention_mask)."""
    out = sample_seeded(model, tokenizer, enc, seeds, max_new_tokens=settings.max_new_tokens,
                        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                        stop=settings.stop, min_new_tokens=fixed_length_tokens(settings)).cpu()
    ends = stop_ids(tokenizer)
    mask = response_mask(out, ends) * (out != tokenizer.pad_token_id if tokenizer.pad_token_id not in ends else 1)
    responses = [truncate_at_stop(t, settings.stop) for t in decode(tokenizer, out, mask)]
    return list(zip(responses, mask.sum(1).tolist()))


def fixed_length_tokens(settings) -> int:
    """min_new_tokens for a sampling section: all of max_new_tokens when it asks for fixed-length responses."""
    return settings.max_new_tokens if getattr(settings, "fixed_length", False) else 0


def truncate_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (generation stops on the token that completes it)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut].rstrip()


def stop_ids(tokenizer) -> list[int]:
    """The ids a response ends at: the tokenizer's EOS, and the other end ids the model's generation config lists
    (Gemma's <end_of_turn>, Llama 3's <|eot_id|> beside <|end_of_text|>), as transformers' generate() stops there."""
    listed = getattr(tokenizer, STOP_IDS, None) or [tokenizer.eos_token_id]
    return [token for token in dict.fromkeys(listed) if token is not None]


def is_stop(responses: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Where `responses` holds one of the stop ids (bool, its shape)."""
    return is_end(responses, torch.tensor(ids, dtype=responses.dtype, device=responses.device))


def response_mask(responses: torch.Tensor, eos: int | list[int] | None) -> torch.Tensor:
    """1 on response tokens up to and including the first EOS (`eos`: an id, or stop_ids); 0 after it (padding).
    No EOS token: all ones."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        return torch.ones_like(responses)
    is_eos = is_stop(responses, ids).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return (~after_eos).long()


def decode(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True).strip() for row, m in zip(responses, mask)]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generate() uses them; a plain forward would otherwise shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# Decoders whose embeddings count positions from their input ids past the padding themselves, offset by their
# padding_idx (RoBERTa's family): 0-based positions given to them would shift every token.
OWN_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "xmod",
                 "roberta-prelayernorm"}


def row_positions(model, attention_mask: torch.Tensor) -> dict:
    """The forward's `position_ids` that give each left-padded row its own positions (none for OWN_POSITIONS)."""
    config = getattr(unwrapped(model), "config", None)
    if getattr(config, "model_type", None) in OWN_POSITIONS:
        return {}
    return {"position_ids": position_ids(attention_mask)}


def response_logits_and_hidden(model, prompt_ids, prompt_mask, responses, resp_mask, want_hidden: bool = False):
    """Logits predicting each response token ([B, T, V]) and, optionally, the hidden states at those positions (the
    model's output layer is applied to the response positions only)."""
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, resp_mask], dim=1)
    keep = {"logits_to_keep": responses.shape[1] + 1} if forward_takes(model, "logits_to_keep") else {}
    out = model(input_ids=input_ids, attention_mask=attention, **row_positions(model, attention),
                output_hidden_states=want_hidden, use_cache=False, **keep)
    p = prompt_ids.shape[1]
    logits = out.logits[:, -responses.shape[1] - 1 : -1]
    hidden = out.hidden_states[-1][:, p - 1 : -1] if want_hidden else None
    return logits, hidden


# Architectures whose logits are exactly lm_head(backbone output): no softcapping or logit scaling after the head.
PLAIN_HEADS = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3"}


def backbone_and_head(model):
    """(backbone, output layer) when the logits are a plain nn.Linear of the backbone's last hidden state, else None
    (other architectures, remote code, a LoRA-wrapped head, or a head that ZeRO-3 partitions and only its own forward
    gathers)."""
    inner = unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    backbone = getattr(inner, getattr(inner, "base_model_prefix", "") or "_", None)
    if (getattr(inner.config, "model_type", None) not in PLAIN_HEADS
            or not type(inner).__module__.startswith("transformers.models.")
            or type(head) is not torch.nn.Linear or hasattr(head.weight, "ds_id") or backbone is None):
        return None
    return backbone, head


def response_logprobs(model, prompt_ids, prompt_mask, responses, resp_mask, temperature: float = 1.0,
                      want_hidden: bool = False):
    """(log p(response token), entropy) per response position [B, T] in fp32, under the distribution sampled at
    `temperature`, plus the backbone's last hidden states there [B, T, H] when asked. Where the head is plain, the
    logits never exist for the whole batch (rlaif/algo/logprobs.py); entropy carries no gradient."""
    parts = backbone_and_head(model)
    if parts is None:
        logits, hidden = response_logits_and_hidden(model, prompt_ids, prompt_mask, responses, resp_mask, want_hidden)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1), entropy, hidden
    backbone, head = parts
    if packs(model):  # real tokens only (rlaif/models/packing.py); zeros at padding in every output
        hidden, where = response_states(backbone, prompt_ids, prompt_mask, responses, resp_mask)
        logprobs, entropy = chosen_logprobs(hidden, head.weight, head.bias, responses.reshape(-1)[where], temperature)

        def spread(x):
            out = x.new_zeros(responses.numel(), *x.shape[1:]).index_copy(0, where, x)
            return out.view(*responses.shape, *x.shape[1:])

        return spread(logprobs), spread(entropy), spread(hidden) if want_hidden else None
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, resp_mask], dim=1)
    out = backbone(input_ids=input_ids, attention_mask=attention, **row_positions(model, attention), use_cache=False)
    hidden = out.last_hidden_state[:, prompt_ids.shape[1] - 1 : -1]
    logprobs, entropy = chosen_logprobs(hidden, head.weight, head.bias, responses, temperature)
    return logprobs, entropy, hidden if want_hidden else None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), the distribution that was sampled."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def next_token_logprobs(model, inputs: dict) -> torch.Tensor:
    """fp32 log-softmax of each row's next-token logits, [rows, vocabulary] (rows left-padded: the last position is
    every row's). The output layer runs at that position only where the model takes logits_to_keep (a [rows,
    length, vocabulary] tensor would be gigabytes at a 150k vocabulary), one row at a time: a product with one row
    is the same kernel whatever the batch, so the hf judge (which batches rows) and the judge service (a row per
    request) give the same bits."""
    keep = {"logits_to_keep": 1} if forward_takes(model, "logits_to_keep") else {}
    if "attention_mask" in inputs and "position_ids" not in inputs and forward_takes(model, "position_ids"):
        # Each row's own positions: a model with learned absolute positions (GPT-2) would otherwise count the left
        # padding, and a row's answer would depend on the longest row of its batch.
        keep.update(row_positions(model, inputs["attention_mask"]))
    layer = model.get_output_embeddings()
    handle = layer.register_forward_hook(_row_by_row) if layer is not None else None
    try:
        logits = model(**inputs, **keep).logits[:, -1]
    finally:
        if handle is not None:
            handle.remove()
    return torch.log_softmax(logits.float(), dim=-1)


def _row_by_row(layer, args, _batched):
    """A forward hook that replaces an output layer's result by the same layer's, one input row at a time (its own
    forward, which runs no hooks). On a CPU with one thread: a one-row product's last bits depend on how many threads
    split it (measured on an Intel Xeon), and a judge service's replica runs with its own share of the cores."""
    with _one_thread() if args[0].device.type == "cpu" else contextlib.nullcontext():
        return torch.cat([layer.forward(row) for row in args[0].split(1)])


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
