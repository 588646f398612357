"""The CPU decode step without transformers' forward (rlaif.models.lean_decode): on every family it takes it samples
the tokens, and records the hidden states, that transformers' forward does, through a folded LoRA adapter too; it
stands aside for anything it does not know (other dtypes, autocast, unfolded adapters, hooks, sliding windows,
other architectures), and transformers' forward runs there."""
import pytest
import torch

from rlaif.models import decode, generation
from rlaif.models.lean_decode import LeanDecodeStep, lean_decode_step

EOS, PAD = 1, 0
PROMPTS = [[5, 9, 13, 2, 40], [7, 3], [7, 3], [11, 12, 13], [60, 61, 62, 63, 8, 8, 30]]
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             pad_token_id=PAD, eos_token_id=EOS, max_position_embeddings=64)
FAMILIES = {"llama": ("Llama", dict(num_key_value_heads=4)),
            "llama_gqa_bias": ("Llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
            "mistral": ("Mistral", dict(num_key_value_heads=2, sliding_window=None)),
            "qwen2": ("Qwen2", dict(num_key_value_heads=2)),  # q/k/v biases
            "qwen3": ("Qwen3", dict(num_key_value_heads=2, head_dim=8)),  # q/k norms, head_dim apart from hidden
            # a rotary scaling whose attention factor is not 1, from the model's own rotary embedding
            "llama_yarn": ("Llama", dict(num_key_value_heads=4, rope_parameters=dict(
                rope_type="yarn", factor=2.0, original_max_position_embeddings=16, rope_theta=10000.0)))}


def decoder(kind: str, attention: str = "sdpa"):
    import transformers

    name, extra = FAMILIES[kind]
    config = getattr(transformers, f"{name}Config")(**SIZES, **extra)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model


def left_padded(rows: list[list[int]]) -> dict:
    width = max(map(len, rows))
    return {"input_ids": torch.tensor([[PAD] * (width - len(r)) + r for r in rows]),
            "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])}


def sampled(model, monkeypatch, lean: bool, steps: int = 10, min_new_tokens: int = 10):
    """Tokens and the hidden states they were sampled from, with the lean step on or off; and how many lean steps
    ran."""
    calls = []
    real_call = LeanDecodeStep.__call__
    monkeypatch.setattr(LeanDecodeStep, "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    monkeypatch.setattr(decode, "lean_decode_step", lean_decode_step if lean else (lambda *_: None))
    tokenizer = type("Tokenizer", (), {"eos_token_id": EOS, "pad_token_id": PAD})
    with torch.no_grad():
        tokens, hidden = generation.sample(model, tokenizer, left_padded(PROMPTS), max_new_tokens=steps,
                                           temperature=1.0, num_return_sequences=2, seed=3,
                                           min_new_tokens=min_new_tokens,
                                           decoder="static", want_hidden=True)
    return tokens, hidden, len(calls)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_the_lean_step_samples_what_transformers_forward_samples(kind, monkeypatch):
    model = decoder(kind)
    tokens, hidden, lean_steps = sampled(model, monkeypatch, lean=True)
    their_tokens, their_hidden, none = sampled(model, monkeypatch, lean=False)
    assert lean_steps == 9 and none == 0  # every step after the prefill's first token
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(hidden, their_hidden, rtol=1e-5, atol=1e-5)


def test_the_lean_step_under_packed_attention_and_with_rows_ending_early(monkeypatch):
    # PPO's policy runs the packed attention (plain SDPA for unpacked calls); rows that end early are fed padding.
    from rlaif.models.packing import enable_packing

    model = decoder("qwen2")
    assert enable_packing(model)
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6 * model.lm_head.weight.abs().max()  # EOS likely enough to end some rows
    tokens, hidden, lean_steps = sampled(model, monkeypatch, lean=True, min_new_tokens=0)
    their_tokens, their_hidden, _ = sampled(model, monkeypatch, lean=False, min_new_tokens=0)
    ended = (tokens == EOS).any(1)
    assert lean_steps > 0 and 0 < int(ended.sum()) < len(tokens)  # some rows ended, some ran on
    assert torch.equal(tokens, their_tokens)
    torch.testing.assert_close(hidden, their_hidden, rtol=1e-5, atol=1e-5)


def test_greedy_lean_steps_equal_transformers_generate_with_eager_attention():
    model = decoder("llama_gqa_bias", attention="eager")
    enc = left_padded(PROMPTS)
    assert lean_decode_step(model) is not None
    ours = decode.decode_static(model, enc, [0] * len(PROMPTS), max_new_tokens=12, temperature=0, eos_ids=[EOS],
                                pad_id=PAD)
    theirs = model.generate(**enc, do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(ours, theirs[:, enc["input_ids"].shape[1]:])


def test_a_folded_lora_adapter_is_sampled_through_the_lean_step(monkeypatch):
    from peft import LoraConfig, get_peft_model

    from rlaif.models.adapters import adapter_folded, adapter_fused

    model = get_peft_model(decoder("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                           "gate_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)  # a zero-initialised B would make the adapter a no-op
    assert lean_decode_step(model) is None  # the adapter as peft runs it: two extra matmuls the lean step lacks
    with adapter_fused(model.base_model.model):
        assert lean_decode_step(model) is None  # training's fused forward: not the base layer's call
    with adapter_folded(model):
        assert lean_decode_step(model) is not None
        tokens, hidden, lean_steps = sampled(model, monkeypatch, lean=True)
        their_tokens, their_hidden, _ = sampled(model, monkeypatch, lean=False)
    unfolded_tokens, _, unfolded_lean_steps = sampled(model, monkeypatch, lean=True)
    assert lean_steps == 9 and unfolded_lean_steps == 0
    assert torch.equal(tokens, their_tokens) and torch.equal(tokens, unfolded_tokens)
    torch.testing.assert_close(hidden, their_hidden, rtol=1e-5, atol=1e-5)


def test_the_lean_step_stands_aside_where_it_would_not_compute_the_models_forward():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM, StaticCache

    model = decoder("llama")
    assert lean_decode_step(model) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lean_decode_step(model) is None
    assert lean_decode_step(model.train()) is None  # attention dropout
    model.eval()
    for module in (model.model.layers[1].mlp, model, model.model):  # a probe, an offload hook, a logits edit
        handle = module.register_forward_hook(lambda *_: None)
        assert lean_decode_step(model) is None
        handle.remove()
    with generation.LastHiddenRecorder(model) as recorder:  # the sampler's own hook on the backbone
        assert lean_decode_step(model, recorder=recorder) is not None
        handle = model.model.register_forward_hook(lambda *_: None)
        assert lean_decode_step(model, recorder=recorder) is None  # and another one
        handle.remove()
    attention = model.model.layers[0].self_attn
    attention.forward = attention.forward  # a forward replaced on the instance (as accelerate's hooks do)
    assert lean_decode_step(model) is None
    del attention.forward
    model.model.layers[2].mlp.down_proj._hf_hook = object()
    assert lean_decode_step(model) is None
    del model.model.layers[2].mlp.down_proj._hf_hook
    assert lean_decode_step(model) is not None
    assert lean_decode_step(decoder("llama").to(torch.float64)) is None
    windowed = MistralForCausalLM(MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=4)).eval()
    assert lean_decode_step(windowed, StaticCache(config=windowed.config, max_cache_len=32)) is None
    assert lean_decode_step(model, StaticCache(config=model.config, max_cache_len=32)) is not None
    assert lean_decode_step(decoder("llama", attention="flex_attention")) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert lean_decode_step(gpt2) is None
