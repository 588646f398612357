"""Static-shape decoding with per-row seeds drawn on the device (CUDA graphs on GPUs, eager steps on CPUs).

`generate()` with a logits processor pays host work on every token: Python in the decode loop, the processor's
per-row draws, a growing KV cache (a new shape, so new kernels, per step). Here the KV cache is preallocated
(transformers' StaticCache), a decode step (forward, filtering, sampling, EOS bookkeeping) reads and writes only
fixed tensors, so it is captured once as a CUDA graph and replayed per token; the host checks for the end only
every few steps. Off CUDA the steps run eagerly, and attention reads only the cache slots written so far. The
random numbers come from a counter-based hash of (row seed, token index) computed on the device: one uniform per row
and token, used by inverse-CDF sampling, so a row's tokens depend only on its own seed and logits, whichever rows
share its batch (the property the generate stage's per-sample seeds promise).

It draws different (equally distributed) samples than the CPU path (`PerRowSampler`'s torch.Generator streams),
and from `generate()`'s. On CPUs it runs the same steps eagerly: no growing cache to copy, no logits processors,
22-34% less time than `generate()` on the demo policy (2026-11-25, BENCHMARKS.md); since then, for Llama-family
decoders, a step runs the layers' arithmetic without transformers' forward (lean_decode.py), whose small operators
were a third of a CPU step.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import NamedTuple

import torch

from rlaif.models.adapters import unwrapped
from rlaif.models.lean_decode import lean_decode_step
from rlaif.models.packing import alibi_attention, prefix_owners, windowed_attention

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays inside int64, so the hash is exact on every device.
MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
STEP_SALT = 0x9E3779B9
END_CHECK_EVERY = 4  # decode steps between host checks for "every row has ended" (each check is one sync)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift-multiply rounds) in int64 arithmetic."""
    x = x & MASK32
    for multiplier in MULTIPLIERS:
        x = ((x ^ (x >> 16)) * multiplier) & MASK32
    return x ^ (x >> 16)


def seed_keys(seeds: list[int], device) -> torch.Tensor:
    """One 32-bit key per row from Python int seeds of any size (folded 32 bits at a time)."""
    folded = []
    for seed in seeds:
        seed, key = abs(int(seed)), 0
        while True:
            key ^= seed & MASK32
            seed >>= 32
            if not seed:
                break
        folded.append(key)
    return mix32(torch.tensor(folded, dtype=torch.int64, device=device))


def row_uniforms(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) per row key and token index, a function of those two only (24 random bits); keys [B, 1]
    and indices [T] give [B, T]."""
    bits = mix32(keys ^ mix32(index + STEP_SALT))
    return ((bits >> 8).float() + 0.5) * 2.0**-24


def choose_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """Token per row: argmax at temperature 0, else the inverse CDF of softmax(logits / T) (after top-k and top-p
    filtering) at the row's uniform. Shapes are fixed (no host sync), so this is captured with the model step."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        # The smallest prefix of the sorted tokens whose mass reaches top_p (the first token is always kept).
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.cumsum(-1)
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1)).clamp_(max=logits.shape[-1] - 1)
    return (order.gather(-1, index) if order is not None else index).squeeze(-1)


def _static_cache_api() -> bool:
    """transformers 5.23 or later: StaticCache(config, max_cache_len) whose layers count their own positions."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 23)


STATIC_CACHE_API = _static_cache_api()


def supports_static_decode(model) -> bool:
    """Models whose forward takes a StaticCache and a prepared 4D mask without host syncs (transformers marks them
    as compilable in full graphs: Llama, Qwen2, Mistral, Gemma and most decoder-only families), unless DeepSpeed
    ZeRO-3 partitions their weights (its forward hooks gather them with collectives, which a graph cannot hold) or a
    layer attends through a sliding window (its cache layer keeps only the window's keys, which the decoder's mask
    over every slot does not describe), or attention is biased by ALiBi (built from a 2D padding mask, not the
    prepared 4D one): generate() samples those."""
    if (not getattr(model, "_can_compile_fullgraph", False) or not hasattr(model, "config") or not STATIC_CACHE_API
            or windowed_attention(model.config) or alibi_attention(model.config)):
        return False
    return not any(hasattr(weight, "ds_id") for weight in model.parameters())


def forward_takes(model, name: str) -> bool:
    """Does the model's forward (under a PEFT wrapper, the base model's) take this argument? logits_to_keep: the
    output layer at the last positions only; cache: transformers 5.24's name for past_key_values."""
    inner = unwrapped(model)
    return _type_forward_takes(type(inner), name)


@functools.cache
def _type_forward_takes(model_type: type, name: str) -> bool:
    return name in inspect.signature(model_type.forward).parameters


def key_slots(prompt_len: int, max_new_tokens: int) -> int:
    """Cache length for a batch: rounded up to 16, so attention kernels take the mask without copying it, and
    batches whose prompts differ by a few tokens share one captured graph."""
    return -(-(prompt_len + max_new_tokens) // 16) * 16


def is_end(tokens: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Where `tokens` holds one of the end ids `ends` (a 1-D tensor on their device), as bools of their shape: a
    broadcast comparison, with no host sync, so it also runs inside a captured CUDA graph."""
    return (tokens[..., None] == ends).any(-1)


class StaticDecode:
    """One batch shape's decode state: the preallocated cache and the buffers every step updates in place. `load`
    puts a new batch of that shape in them, so a graph captured on an earlier batch replays on it."""

    def __init__(self, model, batch: int, slots: int, device, *, max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, eos_ids: tuple[int, ...], pad_id: int, min_new_tokens: int):
        from transformers import StaticCache

        self.model, self.batch, self.max_new_tokens = model, batch, max_new_tokens
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        # Every id a response ends at (none: rows run to max_new_tokens).
        self.eos_ids = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
        self.pad_id, self.min_new_tokens = pad_id, min_new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=slots)
        # transformers 5.24 renamed forward's past_key_values to cache (the old name warns, then goes in 5.40).
        self.cache_argument = {"cache" if forward_takes(model, "cache") else "past_key_values": self.cache}
        # bf16 under the GPU's autocast (attention runs in bf16 there), the weights' dtype elsewhere.
        cache_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else next(model.parameters()).dtype
        # Off CUDA (no graph, whose shapes are fixed) attention reads only the key slots written so far, not the
        # whole preallocated cache: PPO's generate phase 7% shorter at the demo size, decode attention a third
        # shorter at 28M parameters (BENCHMARKS.md). It costs a host read per step.
        self.trim_reads = torch.device(device).type != "cuda"
        self.lean = None  # off CUDA, a step without transformers' forward where it applies (lean_decode.py)
        self.reads = KeyReads()
        for layer in self.cache.layers:
            cast_on_update(layer, cache_dtype, self.reads)
        self.additive_mask = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.key_index = torch.arange(slots, device=device)
        self.key_valid = torch.zeros((batch, slots), dtype=torch.bool, device=device)
        # Each row's uniform for every response index, drawn at load: a step reads one column.
        self.uniforms = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        self.next_position = torch.zeros((batch, 1), dtype=torch.long, device=device)  # first response position
        self.prompt_len = torch.zeros((), dtype=torch.long, device=device)
        self.tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
        self.index = torch.zeros((), dtype=torch.long, device=device)  # response index of the token fed next
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)

    def load(self, enc: dict, seeds: list[int]) -> None:
        """Start a batch: its prompts' key slots, positions and seeds, an empty cache and response."""
        prompt_mask = enc["attention_mask"].bool()
        prompt_len = prompt_mask.shape[1]
        self.cache.reset()
        self.key_valid.zero_()
        self.key_valid[:, :prompt_len] = prompt_mask
        self.key_valid[:, prompt_len : prompt_len + self.max_new_tokens] = True
        steps = torch.arange(self.max_new_tokens, device=self.uniforms.device)
        self.uniforms.copy_(row_uniforms(seed_keys(seeds, self.uniforms.device)[:, None], steps))
        self.next_position.copy_(prompt_mask.sum(1, keepdim=True))
        self.prompt_len.fill_(prompt_len)
        self.tokens.fill_(self.pad_id)
        self.index.zero_()
        self.done.zero_()

    def autocast(self):
        # cache_enabled=False: cached bf16 weight copies would be freed under a captured graph.
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.key_index.is_cuda, cache_enabled=False)

    def mask(self, visible: torch.Tensor) -> torch.Tensor:
        """sdpa and flash kernels take the boolean mask; eager attention adds a float one."""
        if not self.additive_mask:
            return visible
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, torch.finfo(torch.float32).min)

    def prefill(self, ids: torch.Tensor, recorder=None) -> None:
        """Run the prompts, sample each row's first token. Adjacent rows with one prompt (a GRPO group, a pair's
        two samples) run it once: its keys and values are written into each of its rows, and the hidden state a
        `recorder` (generation.LastHiddenRecorder) kept of it is given to each row too."""
        prompt_len = ids.shape[1]
        runs = prompt_runs(ids, self.key_valid[:, :prompt_len]) if spreadable(self.cache) else None
        rows = runs.first_rows if runs is not None else slice(None)
        slots = self._read_slots(lambda: prompt_len)
        valid, key_index = self.key_valid[rows, :slots], self.key_index[:slots]
        query = torch.arange(prompt_len, device=ids.device)
        visible = valid[:, None, None, :] & (key_index <= query[:, None])[None, None]
        # A padding query sees no valid key; letting it see itself keeps its (unused) outputs finite.
        visible |= (key_index == query[:, None])[None, None]
        positions = (valid[:, :prompt_len].long().cumsum(1) - 1).clamp(min=0)
        # The last position's logits only, not [batch, prompt, vocabulary].
        keep = {"logits_to_keep": 1} if forward_takes(self.model, "logits_to_keep") else {}
        with self.autocast(), cache_writes_spread(self.cache, runs):
            logits = self.model(input_ids=ids[rows], attention_mask=self.mask(visible), position_ids=positions,
                                use_cache=True, **self.cache_argument, **keep).logits[:, -1]
        if runs is not None:
            logits = logits.index_select(0, runs.row_run)
            if recorder is not None:
                recorder.spread_last(runs.row_run)
        self.lean = lean_decode_step(self.model, self.cache, recorder) if self.trim_reads else None
        self._record(logits)

    def step(self) -> None:
        """Feed the token at response index `index`, sample the next one: on CUDA fixed shapes and no host sync (a
        graph replays it); off CUDA the key slots read grow by one per step."""
        fed = self.tokens.index_select(1, self.index.view(1))
        slots = self._read_slots(lambda: int(self.prompt_len + self.index) + 1)
        if self.lean is not None:
            logits = self.lean(self, fed, slots)
        else:
            visible = self.key_valid[:, :slots] & (self.key_index[:slots] <= self.prompt_len + self.index)
            with self.autocast():
                logits = self.model(input_ids=fed, attention_mask=self.mask(visible[:, None, None, :]),
                                    position_ids=self.next_position + self.index, use_cache=True,
                                    **self.cache_argument).logits[:, -1]
        self.index.add_(1)
        self._record(logits)

    def _read_slots(self, written) -> int | None:
        """The key slots this forward's attention reads: the `written()` first ones where reads are trimmed, all
        (None) otherwise."""
        self.reads.limit = written() if self.trim_reads else None
        return self.reads.limit

    def _record(self, logits: torch.Tensor) -> None:
        """Sample response token `index` (EOS barred before min_new_tokens), pad it after a row's EOS."""
        logits = logits.float()
        if len(self.eos_ids) and self.min_new_tokens:
            barred = self.index < self.min_new_tokens
            logits[:, self.eos_ids] = torch.where(barred, float("-inf"), logits[:, self.eos_ids])
        token = choose_tokens(logits, self.uniforms.index_select(1, self.index.view(1))[:, 0], **self.sampling)
        token = torch.where(self.done, self.pad_id, token)
        self.done |= is_end(token, self.eos_ids)
        self.tokens.index_copy_(1, self.index.view(1), token[:, None])

    def responses(self) -> torch.Tensor:
        """Token ids [batch, <= max_new_tokens], cut after the token where the last row ended (as generate())."""
        is_eos = is_end(self.tokens, self.eos_ids).long()
        lengths = ((is_eos.cumsum(1) - is_eos) == 0).sum(1)  # tokens up to and including each row's first EOS
        return self.tokens[:, : int(lengths.max())]


class PromptRuns(NamedTuple):
    first_rows: torch.Tensor  # the first row of each run of adjacent rows with one prompt
    row_run: torch.Tensor  # each row's run


def prompt_runs(ids: torch.Tensor, mask: torch.Tensor) -> PromptRuns | None:
    """Runs of adjacent rows whose prompt (tokens and padding) is the same, as the packed forwards find them
    (packing.prefix_owners over the whole prompt); None where no row repeats the row above."""
    starts = prefix_owners(ids, mask.bool())[:, -1] == torch.arange(len(ids), device=ids.device)
    if bool(starts.all()):
        return None
    return PromptRuns(starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1)


def spreadable(cache) -> bool:
    """Caches whose only per-row state is keys and values (not an indexer's keys, a linear-attention state)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    return all(type(layer) in (StaticLayer, StaticSlidingWindowLayer) for layer in cache.layers)


@contextlib.contextmanager
def cache_writes_spread(cache, runs: PromptRuns | None):
    """While a prefill runs each run's prompt once: every cache layer writes a prompt's keys and values into all the
    rows of its run, and gives attention those of the prompts it ran. The layers' own update comes back after."""
    if runs is None:
        yield
        return
    own = [layer.__dict__.get("update") for layer in cache.layers]  # cast_on_update's wrapper, if any

    def spread(update):
        def update_runs(key_states, value_states, *args, **kwargs):
            keys, values = update(key_states.index_select(0, runs.row_run),
                                  value_states.index_select(0, runs.row_run), *args, **kwargs)
            return keys.index_select(0, runs.first_rows), values.index_select(0, runs.first_rows)

        return update_runs

    for layer in cache.layers:
        layer.update = spread(layer.update)
    try:
        yield
    finally:
        for layer, update in zip(cache.layers, own):
            if update is None:
                del layer.update  # the class's method again, not a bound copy on the instance (a reference cycle)
            else:
                layer.update = update


class KeyReads:
    """How many of a cache's key slots attention reads (None: all); the decode state sets it before each forward."""

    limit: int | None = None


def cast_on_update(layer, dtype: torch.dtype, reads: KeyReads) -> None:
    """Store keys and values in one dtype: under autocast a Llama's keys leave the rotary embedding in fp32 while
    its values are bf16, and a preallocated cache holds a single dtype; give attention the first `reads.limit` slots.
    The wrapper holds the layer weakly: a reference cycle would keep the cache's tensors alive until the garbage
    collector's next full pass."""
    update, owner = type(layer).update, weakref.ref(layer)

    def update_cast(key_states, value_states, *args, **kwargs):
        keys, values = update(owner(), key_states.to(dtype), value_states.to(dtype), *args, **kwargs)
        return keys[:, :, : reads.limit], values[:, :, : reads.limit]

    layer.update = update_cast


@torch.no_grad()
def decode_static(model, enc: dict, seeds: list[int], *, max_new_tokens: int, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, eos_ids: list[int], pad_id: int, min_new_tokens: int = 0,
                  cuda_graph: bool | None = None, recorder=None) -> torch.Tensor:
    """Response token ids [batch, <= max_new_tokens], row i sampled from seeds[i] (temperature 0: greedy); rows are
    padded after their EOS. `cuda_graph` (default: on CUDA) replays a captured decode step; the graph and its state
    are kept for the next batch of the same shape (GRAPHS_KEPT shapes at most). `recorder`: a LastHiddenRecorder
    hooked on the model, told which rows share the prefill's hidden states."""
    ids = enc["input_ids"]
    use_graph = ids.is_cuda if cuda_graph is None else cuda_graph
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_ids=tuple(eos_ids), pad_id=pad_id, min_new_tokens=min_new_tokens)  # hashable: a graph's key
    shape = (ids.shape[0], key_slots(ids.shape[1], max_new_tokens), str(ids.device))
    kept = CAPTURED.find(model, shape, settings) if use_graph else None
    state = kept[0] if kept else StaticDecode(model, shape[0], shape[1], ids.device, **settings)
    state.load(enc, seeds)
    state.prefill(ids, recorder)
    steps, done = max_new_tokens - 1, 0
    run_step = kept[1] if kept else state.step
    if use_graph and not kept and steps > 3:
        run_step, done = capture(state), 2  # the two warm-up steps were real decode steps
        CAPTURED.keep(model, shape, settings, state, run_step)
    while done < steps:
        run_step()
        done += 1
        if min_new_tokens < max_new_tokens and done % END_CHECK_EVERY == 0 and bool(state.done.all()):
            break
    return state.responses()


class CapturedGraphs:
    """Captured decode graphs by (model, batch shape, sampling settings), least recently used dropped first. A graph
    reads the model's weights where they are, so in-place training updates (PPO's optimizer) are seen by the next
    replay; a model that is gone or replaced is a new key."""

    def __init__(self, limit: int):
        self.limit, self.entries = limit, {}

    def _key(self, model, shape, settings) -> tuple:
        return (id(model), *shape, *sorted(settings.items()))

    def find(self, model, shape, settings):
        entry = self.entries.pop(self._key(model, shape, settings), None)
        if entry is None or entry[0]() is not model:
            return None
        self.entries[self._key(model, shape, settings)] = entry  # most recently used last
        return entry[1], entry[2]

    def keep(self, model, shape, settings, state, replay) -> None:
        self.entries[self._key(model, shape, settings)] = (weakref.ref(model), state, replay)
        while len(self.entries) > self.limit:
            self.entries.pop(next(iter(self.entries)))


GRAPHS_KEPT = 8
CAPTURED = CapturedGraphs(GRAPHS_KEPT)


def capture(state: StaticDecode):
    """Two eager steps on a side stream (CUDA graphs need allocator and library state settled first), then one step
    captured; returns the graph's replay. Captured work is recorded, not run: the caller replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        state.step()
        state.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: PPO's asynchronous rollout captures in a thread while the update runs on the main one.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        state.step()
    return graph.replay
