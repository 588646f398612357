"""Sampling and log-probs for causal LMs with left-padded prompts and right-padded responses."""
from __future__ import annotations

import torch


def encode_prompts(tokenizer, texts: list[str], device) -> dict:
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


@torch.no_grad()
def sample(model, tokenizer, enc: dict, *, max_new_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
           num_return_sequences: int = 1, seed: int | None = None) -> torch.Tensor:
    """Response token ids [batch * n, <= max_new_tokens] (KV cache on); rows are padded after their EOS.
    bf16 autocast on GPUs (never on CPUs, where bf16 matmuls are slow)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=enc["input_ids"].is_cuda):
        out = model.generate(
            **enc,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p,
            top_k=top_k or None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_return_sequences,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
    return out[:, enc["input_ids"].shape[1]:]


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 on response tokens up to and including the first EOS; 0 after it (padding)."""
    is_eos = (responses == eos_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return (~after_eos).long()


def decode(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True).strip() for row, m in zip(responses, mask)]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generate() uses them; a plain forward would otherwise shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits_and_hidden(model, prompt_ids, prompt_mask, responses, resp_mask, want_hidden: bool = False):
    """Logits predicting each response token ([B, T, V]) and, optionally, the hidden states at those positions."""
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, resp_mask], dim=1)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids(attention),
                output_hidden_states=want_hidden, use_cache=False)
    p = prompt_ids.shape[1]
    logits = out.logits[:, p - 1 : -1]
    hidden = out.hidden_states[-1][:, p - 1 : -1] if want_hidden else None
    return logits, hidden


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), the distribution that was sampled."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
