"""chosen_logprobs against the plain form (full logits, log-softmax, gather) and a per-token loop: values, entropy
and the gradients to the hidden states, the output weights and bias, for any chunking and temperature."""
import math

import pytest
import torch

from rlaif.algo.logprobs import chosen_logprobs


def loop_logprobs(hidden, weight, bias, tokens, temperature):
    """One token at a time, straight from the definition."""
    out, entropies = [], []
    for h, token in zip(hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)):
        logits = [(h @ w + (bias[v] if bias is not None else 0)) / temperature for v, w in enumerate(weight)]
        top = max(logit.item() for logit in logits)
        log_z = top + math.log(sum(math.exp(logit.item() - top) for logit in logits))
        out.append(logits[token] - log_z)
        entropies.append(-sum(math.exp(logit.item() - log_z) * (logit.item() - log_z) for logit in logits))
    return torch.stack(out).view(tokens.shape), torch.tensor(entropies).view(tokens.shape)


@pytest.mark.parametrize("chunk", [1, 5, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_the_plain_form(chunk, temperature, with_bias):
    torch.manual_seed(0)
    hidden = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True) if with_bias else None
    tokens = torch.randint(0, 11, (3, 4))
    upstream = torch.randn(3, 4, dtype=torch.float64)

    logprobs, entropy = chosen_logprobs(hidden, weight, bias, tokens, temperature, chunk)
    grads = torch.autograd.grad((logprobs * upstream).sum(), [t for t in (hidden, weight, bias) if t is not None])

    logits = (hidden @ weight.t() + (bias if bias is not None else 0)) / temperature
    plain = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    plain_grads = torch.autograd.grad((plain * upstream).sum(), [t for t in (hidden, weight, bias) if t is not None])
    looped, looped_entropy = loop_logprobs(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                           tokens, temperature)

    # fp32 inside (as the update computes): agreement to fp32 precision
    torch.testing.assert_close(logprobs.double(), plain.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs.double(), looped.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), looped_entropy.double(), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(grads, plain_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert not entropy.requires_grad


def test_no_gradient_asked_for_the_frozen_weights():
    torch.manual_seed(1)
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)  # a frozen output layer (LoRA leaves lm_head alone)
    logprobs, _ = chosen_logprobs(hidden, weight, None, torch.randint(0, 9, (6,)), 1.0, 4)
    logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("lora", [False, True])
def test_a_models_response_logprobs_equal_the_full_logits_path(lora):
    """On a tiny Llama (and with a LoRA adapter), response_logprobs' chunked path gives the log-probs, entropy and
    parameter gradients of log_softmax over the model's own full logits, left-padded prompts included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.models.generation import backbone_and_head, response_logits_and_hidden, response_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert backbone_and_head(model) is not None
    prompt_ids, responses = torch.randint(3, 50, (3, 5)), torch.randint(3, 50, (3, 4))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0, 1, 1, 1, 1]])
    resp_mask = torch.tensor([[1, 1, 1, 0], [1] * 4, [1, 1, 0, 0]])
    args = (prompt_ids, prompt_mask, responses, resp_mask)
    trained = [p for p in model.parameters() if p.requires_grad]

    logprobs, entropy, _ = response_logprobs(model, *args, temperature=0.7)
    grads = torch.autograd.grad((logprobs * resp_mask).sum(), trained)
    logits, _ = response_logits_and_hidden(model, *args)
    full = torch.log_softmax(logits.float() / 0.7, -1)
    plain = full.gather(-1, responses[..., None]).squeeze(-1)
    plain_grads = torch.autograd.grad((plain * resp_mask).sum(), trained)

    torch.testing.assert_close(logprobs, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(grads, plain_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
