"""Sampling with the LoRA adapter folded into the base weights (rlaif.models.policy.adapter_folded): the folded model
computes what the adapter computes, the base weights come back as the very tensors they were, and layers that cannot
be folded (bf16 weights, DoRA) are left alone."""
import contextlib

import pytest
import torch

from rlaif.models.adapters import adapter_folded, adapter_fused, foldable_adapter_layers
from rlaif.models.decode import decode_static
from rlaif.models.policy import LORA_TARGETS

IDS = torch.tensor([[0, 0, 5, 9, 13], [7, 3, 11, 12, 13]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def adapted(dtype=torch.float32, use_dora=False):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1,
                         pad_token_id=0)
    lm = get_peft_model(LlamaForCausalLM(config).to(dtype),
                        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, use_dora=use_dora))
    with torch.no_grad():  # a trained adapter: B is zero at initialisation, which would make folding trivially exact
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return lm.eval()


def logits(lm):
    with torch.no_grad():
        return lm(input_ids=IDS, attention_mask=MASK).logits


def test_the_folded_model_computes_what_the_adapter_computes():
    lm = adapted()
    with_adapter, base_only = logits(lm), None
    with lm.disable_adapter():
        base_only = logits(lm)
    assert not torch.allclose(with_adapter, base_only, atol=1e-3)  # the adapter matters here
    with adapter_folded(lm):
        folded = logits(lm)
    torch.testing.assert_close(folded, with_adapter, atol=1e-5, rtol=1e-5)


def test_the_static_decoder_samples_the_same_tokens_folded():
    lm = adapted()
    kwargs = dict(max_new_tokens=10, temperature=1.0, eos_ids=[1], pad_id=0)
    plain = decode_static(lm, {"input_ids": IDS, "attention_mask": MASK}, [3, 4], **kwargs)
    with adapter_folded(lm):
        folded = decode_static(lm, {"input_ids": IDS, "attention_mask": MASK}, [3, 4], **kwargs)
    assert torch.equal(plain, folded)


def test_the_base_weights_come_back_bit_for_bit_and_the_adapter_is_on_again():
    lm = adapted()
    bases = [layer.get_base_layer().weight for layer in foldable_adapter_layers(lm)]
    storage = [(w.data_ptr(), w.detach().clone()) for w in bases]
    before = logits(lm)
    with adapter_folded(lm):
        assert not any(w.data_ptr() == pointer for w, (pointer, _) in zip(bases, storage))
    assert all(w.data_ptr() == pointer and torch.equal(w, copy) for w, (pointer, copy) in zip(bases, storage))
    assert not any("forward" in vars(layer) for layer in foldable_adapter_layers(lm))  # the adapter layers run again
    assert torch.equal(logits(lm), before)


def test_folding_and_fusing_refuse_to_nest_and_leave_the_layers_as_they_were():
    lm = adapted()
    before = logits(lm)
    with adapter_folded(lm), pytest.raises(RuntimeError, match="do not nest"), adapter_fused(lm):
        pass  # fusing on folded weights would count the adapter twice
    with adapter_fused(lm), pytest.raises(RuntimeError, match="do not nest"), adapter_folded(lm):
        pass
    assert not any("forward" in vars(layer) for layer in foldable_adapter_layers(lm))
    assert torch.equal(logits(lm), before)


def test_an_error_while_folded_still_restores_the_weights():
    lm = adapted()
    before = logits(lm)
    with pytest.raises(RuntimeError), adapter_folded(lm):
        raise RuntimeError("sampling failed")
    assert torch.equal(logits(lm), before)


@pytest.mark.parametrize("kind", ["bf16", "bf16 autocast", "dora", "no adapter"])
def test_what_cannot_be_folded_is_left_alone(kind):
    if kind == "no adapter":
        from transformers import LlamaConfig, LlamaForCausalLM

        lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2))
    else:
        lm = {"bf16": lambda: adapted(torch.bfloat16), "bf16 autocast": adapted,
              "dora": lambda: adapted(use_dora=True)}[kind]()
    pointers = [p.data_ptr() for p in lm.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16) if kind == "bf16 autocast" else contextlib.nullcontext():
        assert foldable_adapter_layers(lm) == []
        with adapter_folded(lm):
            assert [p.data_ptr() for p in lm.parameters()] == pointers


@pytest.mark.parametrize("bias", [False, True])
def test_the_folded_lora_linear_matches_the_four_matmul_form_and_its_gradients(bias):
    from rlaif.algo.lora import folded_lora_linear

    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weight, lora_a, lora_b = torch.randn(6, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True), \
        torch.randn(6, 2, requires_grad=True)
    b = torch.randn(6, requires_grad=True) if bias else None
    upstream = torch.randn(3, 5, 6)
    leaves = [t for t in (x, weight, b, lora_a, lora_b) if t is not None]

    def gradients(fn):
        out = fn()
        return [out, *torch.autograd.grad((out * upstream).sum(), leaves)]

    plain = gradients(lambda: x @ weight.t() + (x @ lora_a.t()) @ lora_b.t() * 0.7 + (b if bias else 0))
    folded = gradients(lambda: folded_lora_linear(x, weight, b, lora_a, lora_b, 0.7))
    for ours, theirs in zip(folded, plain):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_training_through_the_fused_adapter_gives_peft_s_loss_and_gradients():
    from rlaif.models.adapters import adapter_fused

    def loss_and_grads(fused: bool):
        lm = adapted().train()
        with adapter_fused(lm) if fused else contextlib.nullcontext():
            out = lm(input_ids=IDS, attention_mask=MASK).logits.logsumexp(-1).sum()
            with lm.disable_adapter():  # the reference pass inside the update's context stays the base model
                base = lm(input_ids=IDS, attention_mask=MASK).logits.sum()
            out.backward()
        grads = {n: p.grad for n, p in lm.named_parameters() if p.requires_grad}
        assert all(p.__dict__.get("forward") is None for p in lm.modules())  # the layers' own forward is back
        return out.detach(), base.detach(), grads

    plain, fused = loss_and_grads(False), loss_and_grads(True)
    torch.testing.assert_close(fused[0], plain[0], atol=1e-4, rtol=1e-5)
    assert torch.equal(fused[1], plain[1])
    assert fused[2].keys() == plain[2].keys() and len(plain[2]) == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], atol=1e-4, rtol=1e-4)
