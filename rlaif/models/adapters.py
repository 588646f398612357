"""Running a policy's LoRA adapter folded into its base weights. Sampling (no gradient): each adapted layer becomes
one plain matmul for the whole rollout. Training: each adapted layer is one matmul through rlaif.algo.lora, the
adapter folded inside the call. Both apply to plain linear adapters over fp32 weights on the CPU, where a layer's
small ops cost most; elsewhere the adapter runs as peft runs it (bf16 would round a small adapter away, captured
CUDA graphs keep the weights' addresses, and ZeRO-3 holds a shard of each weight)."""
from __future__ import annotations

import contextlib
import functools

import torch

from rlaif.algo.lora import folded_lora_linear


def unwrapped(model):
    """The transformers model under a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stores_weights_transposed(model) -> bool:
    """GPT-2-style Conv1D layers keep their weights as [in, out]: LoRA over them needs peft's fan_in_fan_out (which
    peft would otherwise switch on per layer, warning at every wrap)."""
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(module, Conv1D) for module in model.modules())


def _not_nested(layers: list) -> list:
    """adapter_folded and adapter_fused each replace the layers' forward: inside one another they would fold the
    adapter twice."""
    if any("forward" in vars(layer) for layer in layers):
        raise RuntimeError("adapter_folded and adapter_fused do not nest: leave one before entering the other")
    return layers


def foldable_adapter_layers(lm) -> list:
    """The LoRA layers of `lm` when every one of them can be folded: one active vanilla adapter (no DoRA or other
    variant, no dropout, no adapter bias, not merged) on a linear layer with fp32 weights on the CPU, outside CPU
    autocast. Else none."""
    if not hasattr(lm, "peft_config") or torch.is_autocast_enabled("cpu"):  # no adapter (and no peft import), or bf16
        return []
    from peft.tuners.lora import Linear, LoraLayer

    def foldable(layer) -> bool:
        weight = layer.get_base_layer().weight
        names = layer.active_adapters
        return (isinstance(layer, Linear) and len(names) == 1 and not layer.merged and not layer.fan_in_fan_out
                and names[0] not in layer.lora_variant and layer.lora_B[names[0]].bias is None
                and isinstance(layer.lora_dropout[names[0]], torch.nn.Identity)
                and weight.dtype == torch.float32 and weight.device.type == "cpu" and not hasattr(weight, "ds_id"))

    layers = [m for m in lm.modules() if isinstance(m, LoraLayer)]
    return layers if layers and all(map(foldable, layers)) else []


@contextlib.contextmanager
def adapter_folded(lm):
    """Runs `lm` (no gradient) with its adapter folded into the base weights: each adapted layer runs as its base
    layer, one matmul, instead of the base matmul, two rank-r matmuls, a scale and an add (22-24% less sampling time
    at the demo size and at 4M parameters on a 2-core CPU, BENCHMARKS.md), and without the adapter layer's own
    per-call work. Equal to the adapter's output up to fp32 rounding; the base weights come back as the very tensors
    they were. A no-op where the layers cannot be folded."""
    layers = _not_nested(foldable_adapter_layers(lm))
    originals = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                originals.append((base, base.weight.data))
                base.weight.data = base.weight.data + layer.get_delta_weight(layer.active_adapters[0])
                layer.forward = base.__call__
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        for base, weight in originals:
            base.weight.data = weight


def _fused_forward(layer, x, *args, **kwargs):
    if layer.disable_adapters or args or kwargs:  # the reference pass, or a call this path does not cover
        return type(layer).forward(layer, x, *args, **kwargs)
    name, base = layer.active_adapters[0], layer.get_base_layer()
    return folded_lora_linear(x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
                              layer.scaling[name])


@contextlib.contextmanager
def adapter_fused(lm):
    """Trains through `lm` with each adapted layer as one matmul (rlaif.algo.lora): the same output and gradients up
    to fp32 rounding, without the adapter's separate [tokens, out] product, scale and add in the forward and their
    twins in the backward. A no-op where the layers cannot be folded."""
    layers = _not_nested(foldable_adapter_layers(lm))
    try:
        for layer in layers:
            layer.forward = functools.partial(_fused_forward, layer)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
