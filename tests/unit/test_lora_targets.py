"""LoRA (PPO's default) on policies of other architectures: Llama-family models take the seven projections peers
configure; a model without those names (GPT-2's c_attn, c_proj, c_fc) takes every linear layer but the output layer,
and trains: one PPO update moves the adapter. Before, peft got an empty target list and ppo failed after three
stages had run."""
import shutil

import pytest
import torch

from rlaif.config import load_config
from rlaif.models.policy import LORA_TARGETS, build_policy


@pytest.fixture(scope="module")
def llama_dir():
    from rlaif.models.loading import resolve_policy

    return resolve_policy(load_config("configs/tiny.yaml").policy)


@pytest.fixture(scope="module")
def gpt2_dir(llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    out = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
                    ).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, out / name)
    return out


def adapted(policy) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in policy.lm.named_modules() if hasattr(module, "lora_A")}


def test_llama_policies_adapt_the_seven_projections(llama_dir):
    cfg = load_config("configs/tiny.yaml", [f"policy.model={llama_dir}", "ppo.lora_rank=4"])
    assert adapted(build_policy(cfg, torch.device("cpu"))[1]) == set(LORA_TARGETS)


def test_a_gpt2_policy_adapts_its_linear_layers_and_trains(gpt2_dir):
    import warnings

    cfg = load_config("configs/tiny.yaml", [f"policy.model={gpt2_dir}", "ppo.lora_rank=4"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fan_in_fan_out")  # GPT-2's Conv1D layers: set, not corrected
        tokenizer, policy, reference_logprobs = build_policy(cfg, torch.device("cpu"))
    assert adapted(policy) == {"c_attn", "c_proj", "c_fc"}  # attention and MLP; never lm_head
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    responses = torch.tensor([[11, 12], [13, 14]])
    ones = torch.ones_like
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    logprobs, _, values = policy(prompts, ones(prompts), responses, ones(responses))
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    (-logprobs.sum() + values.square().sum()).backward()
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters() if "lora_B" in n)
    reference = reference_logprobs(policy, prompts, ones(prompts), responses, ones(responses))
    assert reference.shape == logprobs.shape and torch.isfinite(reference).all()
