"""Forward passes over real tokens only: a batch's rows packed end to end, no padding through the model's layers.

A rollout's rows are left-padded prompts and right-padded responses; a padded forward spends its matmuls on every
padding token (12% more tokens than real ones on the demo prompts in the update's micro-batches of 16 rows, more
when responses end early). Here the backbone runs on the real tokens as one sequence [1, N]: embeddings, norms,
projections and MLPs see only them. Attention, the one place rows must stay apart, scatters that layer's queries,
keys and values back to the padded [rows, width] layout and runs the model's own SDPA attention there with each
row's causal padding mask, then gathers the real positions again. Everything else (rotary embeddings at each row's
own positions, q/k norms, GQA, LoRA layers, the model's scaling) is the model's own code: the attention function
is registered with transformers under PACKED and falls through to plain SDPA for every call that is not packed, so
the sampler and generate() run as before. Where adjacent rows begin alike (a GRPO group's samples of one prompt), the
common prefix runs once and attention reads it back into each row.
"""
from __future__ import annotations

import torch

from rlaif.config.loading import switch
from rlaif.models.adapters import unwrapped

PACKED = "rlaif_packed_sdpa"
# Decoders whose layers take attention from transformers' attention registry with rotary positions from
# position_ids and no per-layer attention pattern (sliding windows, chunked layers) the padded mask would drop.
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
_PREPARED = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a "prepared" 4D mask: transformers builds none for packed calls


class PackedRows:
    """Where the real tokens of a [rows, width] batch (`mask` 1 on them) sit: their flat indices, their positions
    (each row counted from 0, padding skipped, as generate() counts; or the column, as a classifier's forward counts
    them when it is given no positions) and the padded attention mask. Given the token `ids`, a row whose tokens and
    padding agree with the row above it up to some column runs that prefix once: under causal attention its hidden
    states there are the row above's (a GRPO group of 4 runs its prompt once instead of 4 times). On CUDA the shared
    slots' gradients are summed by atomics, so their last bits can differ from run to run."""

    def __init__(self, mask: torch.Tensor, column_positions: bool = False, ids: torch.Tensor | None = None):
        self.rows, self.width = mask.shape
        real = mask.bool()
        columns = torch.arange(self.width, device=mask.device)
        owner = prefix_owners(ids, real) if ids is not None else None
        canonical = real if owner is None else real & (owner == torch.arange(self.rows, device=mask.device)[:, None])
        self.index = canonical.reshape(-1).nonzero().squeeze(1)
        counted = columns.expand_as(real) if column_positions else real.long().cumsum(1) - 1
        self.positions = counted.reshape(-1).index_select(0, self.index)
        # The packed slot of every padded position: its own, or its prefix owner's (-1 at padding).
        slot = torch.full((self.rows * self.width,), -1, dtype=torch.long, device=mask.device)
        slot[self.index] = torch.arange(len(self.index), device=mask.device)
        self.shared = len(self.index) < int(real.sum())
        if self.shared:
            slot = torch.where(real, slot[owner * self.width + columns], -1).reshape(-1)
        self.source = slot
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=mask.device).tril()
        # A padding query sees only itself: its (discarded) output stays finite, so its zero gradient stays zero.
        visible = (causal & real[:, None, :]) | torch.eye(self.width, dtype=torch.bool, device=mask.device)
        self.visible = visible[:, None]

    def slots(self, index: torch.Tensor) -> torch.Tensor:
        """Packed positions of flat padded indices (which must be real tokens): a shared token's is its owner's."""
        return self.source[index]

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, heads, N, D] -> [rows, heads, width, D]: zeros at padding, or (shared prefixes) any finite values there,
        which only the padding's own discarded query sees."""
        flat = packed[0].transpose(0, 1)
        if self.shared:
            out = flat.index_select(0, self.source.clamp(min=0))
        else:
            out = flat.new_zeros(self.rows * self.width, *flat.shape[1:]).index_copy(0, self.index, flat)
        return out.view(self.rows, self.width, *flat.shape[1:]).transpose(1, 2)

    def attend(self, module, query, key, value, dropout, scaling, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(module, self.padded(query), self.padded(key), self.padded(value),
                                        self.visible, dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
        # [rows, width, heads, D] -> the real positions, [1, N, heads, D] as the model's attention expects
        return out.reshape(self.rows * self.width, *out.shape[2:]).index_select(0, self.index)[None], None


def prefix_owners(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[rows, width]: the first row of the run of adjacent rows that agree with each row on every column up to and
    including this one (tokens where real, padding as padding); the row itself where the row above differs."""
    key = torch.where(real, ids, -1)
    agrees = (key[1:] == key[:-1]).long().cumprod(1).bool()  # row i+1 matches row i on every column so far
    linked = torch.cat([torch.zeros_like(key[:1], dtype=torch.bool), agrees])
    rows = torch.arange(len(key), device=key.device)[:, None].expand_as(key)
    return torch.where(linked, 0, rows).cummax(0).values


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, packed_rows=None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return packed_rows.attend(module, query, key, value, dropout, scaling, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED, _attention)
    AttentionMaskInterface.register(PACKED, sdpa_mask)


def enable_packing(model) -> bool:
    """Switch a decoder (or a classifier on one) that runs SDPA attention to PACKED, which is plain SDPA unless a
    call packs its rows; True where packed forwards apply. Not for a sliding attention window; never with
    RLAIF_PACKING=off (the padded forward, to compare or to rule packing out). ZeRO-3 shards are refused per call
    (packs): DeepSpeed partitions the model after it is built."""
    if switch("RLAIF_PACKING") == "off":
        return False
    inner = unwrapped(model)
    config = getattr(inner, "config", None)
    if (config is None or getattr(config, "model_type", None) not in MODEL_TYPES
            or config._attn_implementation not in ("sdpa", PACKED)
            or windowed_attention(config)):
        return False
    if config._attn_implementation != PACKED:
        _register()
        inner.set_attn_implementation(PACKED)
    return True


def windowed_attention(config) -> bool:
    """Does any layer attend through a sliding window (Mistral v0.1, Gemma 2/3, Qwen2 with use_sliding_window)?"""
    return bool(getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
                or "sliding_attention" in (getattr(config, "layer_types", None) or ()))


def alibi_attention(config) -> bool:
    """Position information as ALiBi attention biases (Falcon with alibi, BLOOM, MPT) instead of rotary or learned
    embeddings."""
    attention = getattr(config, "attn_config", None)
    return bool(getattr(config, "alibi", False) or config.model_type == "bloom"
                or getattr(attention, "alibi", None) or (isinstance(attention, dict) and attention.get("alibi")))


def packs(model) -> bool:
    """Does this model take packed forwards? (Not once DeepSpeed ZeRO-3 has partitioned it, which happens after the
    policy is built: its weights exist only inside each module's own forward.)"""
    inner = unwrapped(model)
    if getattr(getattr(inner, "config", None), "_attn_implementation", None) != PACKED:
        return False
    return not hasattr(next(inner.parameters(), None), "ds_id")


def packed_states(backbone, input_ids: torch.Tensor, rows: PackedRows, keep: torch.Tensor) -> torch.Tensor:
    """The backbone's last hidden states [K, H] at the packed positions `keep` of [rows, width] inputs whose real
    tokens `rows` holds. The model's own layers, run as its forward runs them, except that the last layer's MLP (the
    bulk of a layer) runs on the kept tokens only: no later layer reads the other tokens' outputs. (The last layer's
    parts are called one by one, so hooks on the layer itself, gradient checkpointing among them, do not run.)"""
    ids, positions = input_ids.reshape(-1).index_select(0, rows.index)[None], rows.positions[None]
    hidden = backbone.embed_tokens(ids)
    layer_inputs = dict(attention_mask=_PREPARED.to(ids.device), position_ids=positions,
                        position_embeddings=backbone.rotary_emb(hidden, positions), packed_rows=rows)
    *layers, last = backbone.layers[: backbone.config.num_hidden_layers]
    for layer in layers:
        hidden = layer(hidden, **layer_inputs)
    attended, _ = last.self_attn(hidden_states=last.input_layernorm(hidden), **layer_inputs)
    hidden = (hidden + attended)[:, keep]
    hidden = hidden + last.mlp(last.post_attention_layernorm(hidden))
    return backbone.norm(hidden)[0]


def response_states(backbone, prompt_ids, prompt_mask, responses, resp_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The last hidden states that predict each real response token, [M, H], and those tokens' flat indices in the
    [rows, T] responses. A token's predictor is the real token just before it in its row (prompts padded on either
    side); each row's last response token is not fed (it predicts nothing). Adjacent rows with the same prompt run
    it once (PackedRows)."""
    real = resp_mask.bool()
    last = real & (real.long().cumsum(1) == real.sum(1, keepdim=True))
    fed = torch.cat([prompt_mask.bool(), real & ~last], 1)
    input_ids = torch.cat([prompt_ids, responses], 1)
    rows = PackedRows(fed, ids=input_ids)
    columns = torch.arange(fed.shape[1], device=fed.device)
    # The rightmost fed column strictly left of each column (-1: none).
    fed_left = torch.nn.functional.pad(torch.where(fed, columns, -1).cummax(1).values[:, :-1], (1, 0), value=-1)
    row, step = real.nonzero(as_tuple=True)
    before = fed_left[row, prompt_ids.shape[1] + step]
    if not bool((before >= 0).all()):
        raise ValueError("a response token has no prompt token before it: every row needs a prompt")
    states = packed_states(backbone, input_ids, rows, rows.slots(row * fed.shape[1] + before))
    return states, row * responses.shape[1] + step


def packed_scores(classifier, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """A sequence classifier's logits [rows, labels] from a packed forward, pooled as transformers pools them (each
    row's rightmost token that is not the pad token); None where that cannot be done exactly (the token it pools is
    padding, no pad token, a wrapped or unusual head): the caller runs the plain forward then."""
    from transformers.modeling_layers import GenericForSequenceClassification

    if (not packs(classifier) or not isinstance(classifier, GenericForSequenceClassification)
            or classifier.config.get_text_config().pad_token_id is None
            or type(getattr(classifier, "score", None)) is not torch.nn.Linear):
        return None
    pad = classifier.config.get_text_config().pad_token_id
    columns = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.int32)
    pooled = (columns * (input_ids != pad).to(torch.int32)).argmax(-1)  # transformers' expression, ties included
    real = attention_mask.bool()
    if not bool(real.gather(1, pooled[:, None].long()).all()):
        return None
    fed = real & (columns <= pooled[:, None])  # tokens after the pooled one cannot change it (causal attention)
    # The classifier's forward is given no positions: it counts columns.
    rows = PackedRows(fed, column_positions=True, ids=input_ids)
    flat = torch.arange(input_ids.shape[0], device=input_ids.device) * input_ids.shape[1] + pooled.long()
    backbone = getattr(classifier, classifier.base_model_prefix)
    return classifier.score(packed_states(backbone, input_ids, rows, rows.slots(flat)))
