"""A CPU decode step for Llama-family decoders that runs their layers' arithmetic without their modules' forwards.

On a CPU a decode step feeds one token per row, so its matmuls are small and the few hundred other operators of
transformers' forward (module calls, output wrappers, mask preparation, the cache layer's bookkeeping, a norm of six
operators, rotary halves) cost about a third of it: 5-6.6 ms of a 15-18 ms step of 64 rows at 4M parameters on the
2-core CPU (BENCHMARKS.md). This step computes the same thing with the modules' own weights: fused RMSNorm, the
projections as plain matmuls, rotary from the model's own rotary embedding, the new keys and values written into the
static cache's slot, SDPA over the slots written so far. It samples what the transformers forward samples (tested
token for token, and the logits to fp32 rounding) and applies only where every piece is one it knows: Llama,
Mistral, Qwen2 and Qwen3 layers (q/k norms, biases, grouped-query attention), fp32 weights on the CPU without
autocast, plain linear layers or LoRA adapters folded into them (adapters.adapter_folded), no hooks. Elsewhere, and
on GPUs (where a captured CUDA graph removes the host's per-operator cost instead), transformers' forward runs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlaif.models.adapters import unwrapped
from rlaif.models.cpu_kernels import NORMS, own_class
from rlaif.models.packing import MODEL_TYPES, PACKED, windowed_attention

ATTENTION = ("sdpa", "eager", PACKED)  # each computes softmax(q k^T * scaling + mask) v, as SDPA does here


class Norm(NamedTuple):
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Layer(NamedTuple):
    attention_norm: Norm
    query: torch.nn.Linear
    key: torch.nn.Linear
    value: torch.nn.Linear
    query_norm: Norm | None  # Qwen3 normalizes each head's query and key before the rotary embedding
    key_norm: Norm | None
    output: torch.nn.Linear
    mlp_norm: Norm
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    activation: torch.nn.Module
    head_dim: int
    scaling: float


def _folded_base(module) -> torch.nn.Linear | None:
    """The base layer of a LoRA layer whose adapter is folded into it (adapter_folded sets the LoRA layer's forward
    to the base layer's call), else None."""
    if not hasattr(module, "get_base_layer") or "forward" not in vars(module):
        return None
    base = module.get_base_layer()
    return base if type(base) is torch.nn.Linear and vars(module)["forward"] == base.__call__ else None


def _linear(module) -> torch.nn.Linear | None:
    """The plain linear layer a projection runs as: itself, or a folded LoRA layer's base layer; None for anything
    else (an unfolded or fused adapter, a quantized layer, a replaced forward)."""
    if type(module) is torch.nn.Linear and "forward" not in vars(module):
        return module
    return _folded_base(module)


def _norm(module) -> Norm | None:
    if module is None or own_class(module).__name__ not in NORMS:  # the model's class, also under fused kernels
        return None
    return Norm(module.weight, module.variance_epsilon)


def _layer(decoder_layer) -> Layer | None:
    attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
    linears = [_linear(getattr(attention, name, None)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [_linear(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj")]
    norms = [_norm(getattr(decoder_layer, name, None)) for name in ("input_layernorm", "post_attention_layernorm")]
    head_norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
    if None in linears or None in norms or (head_norms[0] is None) != (head_norms[1] is None):
        return None
    if head_norms[0] is not None and None in map(_norm, head_norms):
        return None
    query, key, value, output, gate, up, down = linears
    return Layer(norms[0], query, key, value, *map(_norm, head_norms), output, norms[1], gate, up, down, mlp.act_fn,
                 attention.head_dim, attention.scaling)


def _runs_more_than_its_forward(module, allowed_hooks: set) -> bool:
    """Does `module` run more than its class's forward: hooks (a probe, an offload hook; those of `allowed_hooks`
    aside), an accelerate hook (which replaces the forward), a forward replaced on the instance (other than a folded
    adapter)? (Once anything asks transformers for hidden states or attentions it hooks every layer for good, and
    transformers' forward runs from then on.)"""
    return (bool(set(module._forward_hooks) - allowed_hooks) or bool(module._forward_pre_hooks)
            or hasattr(module, "_hf_hook") or ("forward" in vars(module) and _folded_base(module) is None))


def _applies(model, inner, cache, recorder) -> bool:
    """Is every piece of `model` (the PEFT wrapper, if any, and the transformers model `inner`) one the lean step
    computes as its forward does?"""
    from transformers.cache_utils import StaticLayer

    config, backbone = getattr(inner, "config", None), getattr(inner, "model", None)
    if (config is None or getattr(config, "model_type", None) not in MODEL_TYPES
            or not type(inner).__module__.startswith("transformers.models.")  # not remote code
            or config._attn_implementation not in ATTENTION or windowed_attention(config)
            or torch.is_autocast_enabled("cpu") or inner.training  # training: attention dropout
            or backbone is None or not hasattr(backbone, "rotary_emb") or not hasattr(inner, "lm_head")
            or type(backbone.embed_tokens) is not torch.nn.Embedding):
        return False
    if cache is not None and (len(cache.layers) != config.num_hidden_layers
                              or any(type(layer) is not StaticLayer for layer in cache.layers)):
        return False
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in inner.parameters()):
        return False
    recorder_hook = {recorder.handle.id} if recorder is not None and recorder.handle is not None else set()
    return not any(_runs_more_than_its_forward(module, recorder_hook if module is backbone else set())
                   for module in model.modules())


def lean_decode_step(model, cache=None, recorder=None) -> LeanDecodeStep | None:
    """The lean step for this model and its StaticCache `cache`, or None where it does not apply (module
    docstring). `recorder`: the generation.LastHiddenRecorder hooked on the backbone, fed each step's hidden state
    directly."""
    inner = unwrapped(model)
    if not _applies(model, inner, cache, recorder):
        return None
    backbone = inner.model
    layers = [_layer(layer) for layer in backbone.layers[: inner.config.num_hidden_layers]]
    head, final_norm = _linear(inner.lm_head), _norm(backbone.norm)
    if None in layers or head is None or final_norm is None:
        return None
    return LeanDecodeStep(backbone.embed_tokens, backbone.rotary_emb, layers, final_norm, head, recorder)


class LeanDecodeStep:
    """One decode step of a StaticDecode state (decode.py): feed each row's token at response index `index`, write
    its keys and values into cache slot prompt_len + index, return the logits [batch, vocabulary]. It leaves the
    cache layers' own position counters at the prefill's: every step of a batch after its prefill is lean (the
    state's `load` resets the cache for the next batch)."""

    def __init__(self, embedding, rotary, layers: list[Layer], final_norm: Norm, head, recorder):
        self.embedding, self.rotary, self.layers = embedding, rotary, layers
        self.final_norm, self.head, self.recorder = final_norm, head, recorder

    def __call__(self, state, fed: torch.Tensor, slots: int | None) -> torch.Tensor:
        slot = int(state.prompt_len + state.index)
        visible = state.key_valid[:, :slots] & (state.key_index[:slots] <= slot)
        hidden = F.embedding(fed, self.embedding.weight)  # [batch, 1, H]
        cos, sin = self.rotary(hidden, state.next_position + state.index)
        rotation = (cos[:, None], sin[:, None])  # broadcast over heads
        for layer, cache_layer in zip(self.layers, state.cache.layers):
            hidden = hidden + self._attention(layer, cache_layer, hidden, rotation, visible[:, None, None], slot, slots)
            normed = layer.mlp_norm(hidden)
            gate, up = F.linear(normed, layer.gate.weight, layer.gate.bias), F.linear(normed, layer.up.weight,
                                                                                      layer.up.bias)
            hidden = hidden + F.linear(layer.activation(gate) * up, layer.down.weight, layer.down.bias)
        hidden = self.final_norm(hidden)
        if self.recorder is not None:
            self.recorder.keep(hidden)
        return F.linear(hidden[:, -1], self.head.weight, self.head.bias)

    @staticmethod
    def _attention(layer: Layer, cache_layer, hidden, rotation, visible, slot: int, slots: int | None):
        batch, normed = hidden.shape[0], layer.attention_norm(hidden)
        query = _heads(F.linear(normed, layer.query.weight, layer.query.bias), layer.head_dim, layer.query_norm)
        key = _heads(F.linear(normed, layer.key.weight, layer.key.bias), layer.head_dim, layer.key_norm)
        value = _heads(F.linear(normed, layer.value.weight, layer.value.bias), layer.head_dim, None)
        query, key = _rotate(query, *rotation), _rotate(key, *rotation)
        cache_layer.keys[:, :, slot] = key[:, :, 0]
        cache_layer.values[:, :, slot] = value[:, :, 0]
        attended = F.scaled_dot_product_attention(
            query, cache_layer.keys[:, :, :slots], cache_layer.values[:, :, :slots], attn_mask=visible,
            scale=layer.scaling, enable_gqa=query.shape[1] != key.shape[1])
        return F.linear(attended.transpose(1, 2).reshape(batch, 1, -1), layer.output.weight, layer.output.bias)


def _heads(projected: torch.Tensor, head_dim: int, norm: Norm | None) -> torch.Tensor:
    """[batch, 1, heads * head_dim] -> [batch, heads, 1, head_dim], each head normed first where the model does."""
    heads = projected.view(projected.shape[0], 1, -1, head_dim)
    return (norm(heads) if norm is not None else heads).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in transformers' layout (the halves of each head rotated, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
