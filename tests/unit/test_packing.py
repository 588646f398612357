"""Forward passes over the real tokens only (rlaif.models.packing): the policy's log-probs, entropy, hidden states and
gradients, and a reward model's scores, are what the padded forward gives, for each architecture it is switched on
for; everything else (sampling, export) behaves as with plain SDPA, and it stays off where it would be wrong."""
import copy
import json

import pytest
import torch

from rlaif.errors import UserError
from rlaif.models.decode import decode_static
from rlaif.models.generation import response_logprobs
from rlaif.models.packing import PACKED, enable_packing, packed_scores, packs
from rlaif.models.reward import classifier_scores

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             pad_token_id=0, eos_token_id=1, max_position_embeddings=64)


def decoder(kind: str, head: str = "CausalLM"):
    import transformers

    name, extra = {"llama": ("Llama", dict(num_key_value_heads=4)),
                   "qwen2": ("Qwen2", dict(num_key_value_heads=2)),  # grouped-query attention, q/k/v biases
                   "qwen3": ("Qwen3", dict(num_key_value_heads=2, head_dim=8))}[kind]  # q/k norms
    config = getattr(transformers, f"{name}Config")(**SIZES, **extra, num_labels=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, f"{name}For{head}")(config)


def rollout_rows():
    """Left-padded prompts and right-padded responses of different lengths (one response a single token)."""
    torch.manual_seed(1)
    prompt, prompt_mask = torch.randint(2, 97, (5, 7)), torch.ones(5, 7, dtype=torch.long)
    responses, mask = torch.randint(2, 97, (5, 6)), torch.ones(5, 6, dtype=torch.long)
    for row, (prompt_len, response_len) in enumerate([(7, 6), (3, 2), (5, 4), (1, 1), (6, 5)]):
        prompt[row, : 7 - prompt_len], prompt_mask[row, : 7 - prompt_len] = 0, 0
        responses[row, response_len:], mask[row, response_len:] = 0, 0
    return prompt, prompt_mask, responses, mask


def outputs_and_grads(lm, rows):
    logprobs, entropy, hidden = response_logprobs(lm, *rows, temperature=0.7, want_hidden=True)
    real = rows[3].bool()
    loss = logprobs[real].sum() + hidden[real].square().sum()
    grads = torch.autograd.grad(loss, [p for p in lm.parameters() if p.requires_grad])
    return (logprobs, entropy, hidden), grads


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_packed_log_probs_entropy_hidden_states_and_gradients_are_the_padded_ones(kind):
    padded_lm = decoder(kind)
    packed_lm = copy.deepcopy(padded_lm)
    assert enable_packing(packed_lm) and packs(packed_lm) and not packs(padded_lm)
    rows = rollout_rows()
    (padded, padded_grads), (packed, packed_grads) = outputs_and_grads(padded_lm, rows), outputs_and_grads(packed_lm,
                                                                                                           rows)
    real = rows[3].bool()
    for want, got in zip(padded, packed):
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-5)
        assert not got[~real].any()  # padding positions are zeros, not a padded forward's garbage
    for want, got in zip(padded_grads, packed_grads):
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item() + 1e-6, rtol=1e-4)


def test_packed_forwards_through_a_lora_adapter_and_with_it_disabled():
    from peft import LoraConfig, get_peft_model

    lm = get_peft_model(decoder("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                        "gate_proj"]))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a trained adapter, so that disabling it matters
    rows, real = rollout_rows(), rollout_rows()[3].bool()
    padded = response_logprobs(lm, *rows)[0]
    with lm.disable_adapter():
        padded_reference = response_logprobs(lm, *rows)[0]
    assert enable_packing(lm)
    packed = response_logprobs(lm, *rows)[0]
    with lm.disable_adapter():
        packed_reference = response_logprobs(lm, *rows)[0]
    assert (padded_reference - padded)[real].abs().max() > 1e-3
    torch.testing.assert_close(packed[real], padded[real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed_reference[real], padded_reference[real], atol=2e-5, rtol=1e-5)


def test_packed_reward_scores_pool_the_token_transformers_pools():
    classifier = decoder("llama", "SequenceClassification").eval()
    ids, mask = torch.randint(2, 97, (4, 9)), torch.ones(4, 9, dtype=torch.long)
    ids[0, 6:], mask[0, 6:] = 0, 0  # right padding
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    ids[2, 8] = 0  # a real token that is the pad id: transformers pools the token before it
    with torch.no_grad():
        want = classifier(input_ids=ids, attention_mask=mask).logits
        assert packed_scores(classifier, ids, mask) is None  # not switched on: the caller's plain forward
        assert enable_packing(classifier)
        got = packed_scores(classifier, ids, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Padding that is not the pad id: the pooled token is masked, which only the padded forward reproduces.
        ids[3, 7:], mask[3, 7:] = 5, 0
        want = classifier(input_ids=ids, attention_mask=mask).logits
        assert packed_scores(classifier, ids, mask) is None
        torch.testing.assert_close(classifier_scores(classifier, {"input_ids": ids, "attention_mask": mask}), want)


def test_sampling_is_unchanged_and_the_exported_config_does_not_name_the_packed_attention(tmp_path):
    plain = decoder("llama").eval()
    packed = copy.deepcopy(plain)
    enable_packing(packed)
    prompts = {"input_ids": rollout_rows()[0], "attention_mask": rollout_rows()[1]}
    kwargs = dict(max_new_tokens=8, temperature=1.0, eos_ids=[1], pad_id=0)
    assert torch.equal(decode_static(plain, prompts, [1, 2, 3, 4, 5], **kwargs),
                       decode_static(packed, prompts, [1, 2, 3, 4, 5], **kwargs))
    packed.save_pretrained(tmp_path)
    assert PACKED not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_packing_stays_off_where_the_padded_mask_matters_or_the_architecture_is_unknown():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=4))
    windowed.config._attn_implementation = "sdpa"
    eager = decoder("llama")
    eager.config._attn_implementation = "eager"
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4))
    for model in (windowed, eager, gpt2):
        assert not enable_packing(model) and not packs(model)


def test_rlaif_packing_off_keeps_the_padded_forward_and_a_zero3_partitioned_model_is_not_packed(monkeypatch):
    monkeypatch.setenv("RLAIF_PACKING", "off")
    lm = decoder("llama")
    assert not enable_packing(lm) and not packs(lm)
    monkeypatch.setenv("RLAIF_PACKING", "no")
    with pytest.raises(UserError, match="RLAIF_PACKING='no' is not one of on, off"):
        enable_packing(lm)
    monkeypatch.delenv("RLAIF_PACKING")
    assert enable_packing(lm) and packs(lm)
    next(lm.parameters()).ds_id = 0  # as DeepSpeed ZeRO-3 tags the weights it partitions, after the policy is built
    assert not packs(lm)


def test_a_response_is_predicted_from_the_token_before_it_wherever_the_prompt_padding_is():
    lm = decoder("llama")
    enable_packing(lm)
    prompt, prompt_mask, responses, mask = rollout_rows()
    left = response_logprobs(lm, prompt, prompt_mask, responses, mask)[0]
    # The same prompts padded on the right: only the real tokens' order matters to a packed forward.
    order = torch.argsort(1 - prompt_mask, dim=1, stable=True)
    right = response_logprobs(lm, prompt.gather(1, order), prompt_mask.gather(1, order), responses, mask)[0]
    torch.testing.assert_close(right, left, atol=1e-6, rtol=1e-6)
    empty = prompt_mask.clone()
    empty[3] = 0
    with pytest.raises(ValueError, match="no prompt token before it"):
        response_logprobs(lm, prompt, empty, responses, mask)


def grouped_rows():
    """GRPO's layout: each prompt's samples in adjacent rows, a prompt shared by 3 rows (two of whose responses also
    share their first tokens), one by 2, one alone, and a repeated prompt that is not adjacent (not shared)."""
    prompt, prompt_mask, responses, mask = rollout_rows()
    order = torch.tensor([0, 0, 0, 2, 2, 4, 0])
    prompt, prompt_mask = prompt[order], prompt_mask[order]
    torch.manual_seed(2)
    responses, mask = torch.randint(2, 97, (7, 6)), torch.ones(7, 6, dtype=torch.long)
    responses[1, :3] = responses[0, :3]
    for row, length in enumerate([6, 4, 1, 5, 6, 3, 2]):
        responses[row, length:], mask[row, length:] = 0, 0
    return prompt, prompt_mask, responses, mask


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rows_sharing_a_prompt_run_it_once_with_the_padded_forwards_outputs_and_gradients(kind):
    from rlaif.models.packing import PackedRows

    padded_lm = decoder(kind)
    packed_lm = copy.deepcopy(padded_lm)
    enable_packing(packed_lm)
    rows = grouped_rows()
    fed = torch.cat([rows[1], rows[3]], 1).bool()
    shared = PackedRows(fed, ids=torch.cat([rows[0], rows[2]], 1))
    # The 7-token prompt runs once instead of 3 times, the 5-token one once instead of twice, 3 response tokens once.
    assert int(fed.sum()) - len(shared.index) == 2 * 7 + 5 + 3
    (padded, padded_grads), (packed, packed_grads) = outputs_and_grads(padded_lm, rows), outputs_and_grads(packed_lm,
                                                                                                           rows)
    real = rows[3].bool()
    for want, got in zip(padded, packed):
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-5)
        assert not got[~real].any()
    for want, got in zip(padded_grads, packed_grads):
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item() + 1e-6, rtol=1e-4)
    one_row = [x[:1] for x in rows]  # nothing above it to share with
    torch.testing.assert_close(outputs_and_grads(packed_lm, one_row)[0][0], outputs_and_grads(padded_lm, one_row)[0][0],
                               atol=2e-5, rtol=1e-5)


def test_reward_scores_of_rows_sharing_a_prompt_are_the_padded_ones():
    classifier = decoder("llama", "SequenceClassification").eval()
    prompt, _, responses, mask = grouped_rows()
    ids = torch.cat([prompt, responses], 1)  # right-padded pairs: real prompt, then the response
    attention = torch.cat([torch.ones_like(prompt), mask], 1)
    with torch.no_grad():
        want = classifier(input_ids=ids, attention_mask=attention).logits
        enable_packing(classifier)
        torch.testing.assert_close(packed_scores(classifier, ids, attention), want, atol=1e-5, rtol=1e-5)
