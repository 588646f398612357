"""Log-probabilities of chosen tokens straight from the last hidden states, without a [tokens, vocabulary] logits
tensor that lives through the backward pass.

The plain way, log_softmax(lm_head(h) / T).gather(token), keeps the full logits (and the log-softmax output) of a
whole micro-batch for the backward: at a 32k vocabulary that is 128 KiB per token, more than everything else the
update keeps for a small policy. Here the logits exist one chunk of tokens at a time: the forward keeps only the
chosen token's logit and the log-sum-exp per token; the backward recomputes each chunk's logits (one extra
[chunk, hidden] x [hidden, vocab] matmul) to form softmax - onehot. Where the whole input is one chunk (a
micro-batch of up to 1,024 tokens at vocabularies up to 32k) its softmax, one tensor of at most the chunk budget, is
kept instead of recomputed. Entropy comes out of the same pass, without a gradient (PPO logs it).
"""
from __future__ import annotations

import torch

# fp32 logits per chunk at most: 128 MiB, ~1k tokens at a 32k vocabulary, ~220 at 152k. Smaller chunks turn the
# output layer's matmuls into products of a few dozen rows, far below the matmul peak, and (all weights trained) sum
# its [vocabulary, hidden] gradient once per chunk: on a 2-core AMD EPYC at a 32k vocabulary the PPO update took
# 12.0 s with 8 MiB chunks and 6.8 s with 128 MiB (LoRA: 9.8 and 6.2 s) for 80-150 MiB more peak RSS
# (bench/chunk_budget.py, BENCHMARKS.md; an earlier 2-core machine with AVX-512 had measured 8 MiB a little faster).
CHUNK_ELEMENTS = 2**25
CHUNK_TOKENS = 1024  # and at most this many tokens: at small vocabularies a whole micro-batch would be one chunk


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for this vocabulary: a bounded slice of logits, large enough to keep the matmul efficient."""
    return max(16, min(CHUNK_TOKENS, CHUNK_ELEMENTS // vocab))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """fp32 logits / temperature of a chunk: one [chunk, vocab] tensor, the rest in place (two under bf16)."""
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits += bias
    logits = logits.float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def _chunk_softmax(logits: torch.Tensor, tokens: torch.Tensor):
    """(softmax, log p(token), entropy, log-sum-exp) of a chunk's fp32 logits (overwritten): one exp pass, two
    [chunk, vocab] tensors."""
    top = logits.amax(-1, keepdim=True)
    shifted = logits.sub_(top)
    probs = shifted.exp()
    total = probs.sum(-1, keepdim=True)
    log_total = total.log()
    logprobs = (shifted.gather(-1, tokens[:, None]) - log_total).squeeze(-1)
    probs.div_(total)
    entropy = (log_total - shifted.mul_(probs).sum(-1, keepdim=True)).squeeze(-1)  # log Z - sum p x (logit - top)
    return probs, logprobs, entropy, (top + log_total).squeeze(-1)


class _ChosenLogprobs(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the backward's matmuls run in the forward's autocast state
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk):
        logprobs = torch.empty(tokens.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        # One chunk: its softmax is kept for the backward (within the chunk budget, and alive only from here to the
        # loss's backward), instead of recomputing the logits' matmul and exp there.
        keep = tokens.shape[0] <= chunk and any(ctx.needs_input_grad[:3])
        probs = None
        for start in range(0, tokens.shape[0], chunk):
            part = slice(start, start + chunk)
            probs = None  # the previous chunk's softmax goes before this chunk's logits exist
            probs, logprobs[part], entropy[part], lse[part] = _chunk_softmax(
                _chunk_logits(hidden[part], weight, bias, temperature), tokens[part])
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, probs if keep else None)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, tokens, lse, kept = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] \
            else None
        for start in range(0, tokens.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            if kept is not None:
                grad_logits = kept.mul(-grad_logprobs[part, None])
            else:
                probs = _chunk_logits(hidden[part], weight, bias, ctx.temperature).sub_(lse[part, None]).exp_()
                grad_logits = probs.mul_(-grad_logprobs[part, None])
            # d logp(token) / d logits = (onehot(token) - softmax) / T, scaled by the incoming gradient
            grad_logits.scatter_add_(-1, tokens[part, None], grad_logprobs[part, None])
            grad_logits.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[part] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:  # the matmul in the hidden states' dtype (bf16 under DeepSpeed), summed in fp32
                grad_weight += (grad_logits.to(hidden.dtype).t() @ hidden[part]).float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chosen_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
                    temperature: float = 1.0, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token), entropy) per position under softmax((hidden @ weight.T + bias) / temperature), in fp32.
    hidden [..., H], weight [V, H], tokens [...]; gradients flow to hidden, weight and bias (not through entropy)."""
    shape = tokens.shape
    chunk = chunk or chunk_tokens(weight.shape[0])
    logprobs, entropy = _ChosenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                              tokens.reshape(-1), float(temperature), int(chunk))
    return logprobs.view(shape), entropy.view(shape)
