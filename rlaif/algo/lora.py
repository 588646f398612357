"""A LoRA linear layer as one matmul: y = x (W + s B A)^T + b, with the adapter folded into the weight inside the
call, instead of x W^T + s (x A^T) B^T + b as four matmuls, a scale and an add over the [tokens, out] output.

The folded weight costs out x in x r multiply-adds (1.3% of the layer's matmul at 1,264 tokens and rank 16) and is
rebuilt in the backward rather than kept, so no layer's copy outlives its call. Gradients: dx = g (W + s B A),
dA = s (g B)^T x, dB = s g^T (x A^T), db = sum g; x A^T is the only extra tensor kept for the backward ([tokens, r]).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def folded_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A, [out, in]."""
    return torch.addmm(weight, lora_b, lora_a, alpha=scaling)


class _FoldedLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        projected = x @ lora_a.t() if ctx.needs_input_grad[4] else None  # only dB needs x A^T
        ctx.save_for_backward(x, weight, lora_a, lora_b, projected)
        ctx.scaling = scaling
        return F.linear(x, folded_weight(weight, lora_a, lora_b, scaling), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b, projected = ctx.saved_tensors
        scaling, needs = ctx.scaling, ctx.needs_input_grad
        rows, x_rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad @ folded_weight(weight, lora_a, lora_b, scaling) if needs[0] else None
        grad_weight = rows.t() @ x_rows if needs[1] else None
        grad_bias = rows.sum(0) if needs[2] else None
        grad_a = (rows @ lora_b).t().mm(x_rows).mul_(scaling) if needs[3] else None
        grad_b = rows.t().mm(projected.reshape(-1, projected.shape[-1])).mul_(scaling) if needs[4] else None
        return grad_x, grad_weight, grad_bias, grad_a, grad_b, None


def folded_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """x [..., in] -> [..., out] through weight [out, in] (+ bias) and the adapter lora_a [r, in], lora_b [out, r]
    scaled by `scaling`; gradients reach every tensor that requires them."""
    return _FoldedLora.apply(x, weight, bias, lora_a, lora_b, float(scaling))
