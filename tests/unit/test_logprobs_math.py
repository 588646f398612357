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


@pytest.mark.parametrize("chunk", [4, 64])  # recomputed in the backward; one chunk, its softmax kept
def test_no_gradient_asked_for_the_frozen_weights(chunk):
    torch.manual_seed(1)
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)  # a frozen output layer (LoRA leaves lm_head alone)
    tokens = torch.randint(0, 9, (6,))
    logprobs, _ = chosen_logprobs(hidden, weight, None, tokens, 1.0, chunk)
    logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    leaf = hidden.detach().requires_grad_()
    torch.log_softmax(leaf @ weight.t(), -1).gather(-1, tokens[:, None]).sum().backward()
    torch.testing.assert_close(hidden.grad, leaf.grad)


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied))


@pytest.mark.parametrize("lora,tied", [(False, False), (True, False), (False, True)])
def test_a_models_response_logprobs_equal_the_full_logits_path(lora, tied):
    """On a tiny Llama (with a LoRA adapter, with tied embeddings), response_logprobs' chunked path gives the
    log-probs, entropy and parameter gradients of log_softmax over the model's own full logits, left-padded prompts
    included."""
    from rlaif.models.generation import backbone_and_head, response_logits_and_hidden, response_logprobs

    torch.manual_seed(0)
    model = tiny_llama(tied)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_under_bf16_autocast_on_a_gpu_it_agrees_with_the_plain_form():
    """As the update runs on GPUs: fp32 weights, bf16 autocast, a 32k vocabulary; both forms see the same bf16 logits
    matmul, so they agree to bf16 rounding of the products, not to fp32."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 256, device="cuda", requires_grad=True)
    weight = (torch.randn(32000, 256, device="cuda") / 16).requires_grad_()
    tokens = torch.randint(0, 32000, (2, 300), device="cuda")
    upstream = torch.randn(2, 300, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logprobs, _ = chosen_logprobs(hidden, weight, None, tokens, 0.7, chunk=256)
        grads = torch.autograd.grad((logprobs * upstream).sum(), [hidden, weight])
        plain = torch.log_softmax((hidden @ weight.t()).float() / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
        plain_grads = torch.autograd.grad((plain * upstream).sum(), [hidden, weight])
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=2e-2)
    for ours, theirs in zip(grads, plain_grads):
        assert (ours - theirs).norm() / theirs.norm() < 2e-2


@pytest.mark.parametrize("lora", [False, True])
def test_the_samplers_hidden_states_give_the_recomputed_logprobs_and_values(lora):
    """ppo.rollout_logprobs=sampled: log-probs and values from the hidden states generate() computed while sampling
    (KV cache, one token per step, left-padded prompts, EOS barred for some steps) equal a forward over the finished
    rollout to fp32 rounding."""
    from rlaif.models.generation import response_mask, sample
    from rlaif.models.policy import PolicyWithValue

    torch.manual_seed(0)
    model = tiny_llama(tied=True).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    policy = PolicyWithValue(model, 16, temperature=0.7)
    torch.nn.init.normal_(policy.value_head.weight)

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 1

    enc = {"input_ids": torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16]]),
           "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0, 1, 1, 1, 1]])}
    responses, hidden = sample(model, Tokenizer, enc, max_new_tokens=6, temperature=0.7, num_return_sequences=2,
                               seed=3, min_new_tokens=2, want_hidden=True)
    assert hidden.shape == (6, responses.shape[1], 16)
    mask = response_mask(responses, 1)
    prompt_ids, prompt_mask = (enc[k].repeat_interleave(2, 0) for k in ("input_ids", "attention_mask"))
    with torch.no_grad():
        sampled_logprobs, sampled_values = policy.from_hidden(hidden, responses)
        logprobs, _, values = policy(prompt_ids, prompt_mask, responses, mask)
    real = mask.bool()
    torch.testing.assert_close(sampled_logprobs[real], logprobs[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sampled_values[real], values[real], rtol=1e-5, atol=1e-5)


def test_chunks_are_bounded():
    from rlaif.algo.logprobs import chunk_tokens

    assert chunk_tokens(1024) == chunk_tokens(32000) == 1024  # small vocabularies: capped in tokens
    assert chunk_tokens(152_064) == 220 and chunk_tokens(4_000_000) == 16  # large ones: bounded in logits
