"""The policy PPO trains: the causal LM with a scalar value head on its backbone (one pass gives the response
tokens' log-probs, their entropy and the values), and the reference it is held to (the LoRA adapter disabled, or a
frozen copy when all weights train)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from rlaif.algo.logprobs import chosen_logprobs
from rlaif.models.adapters import stores_weights_transposed
from rlaif.models.cpu_kernels import fuse
from rlaif.models.generation import backbone_and_head, response_logprobs
from rlaif.models.loading import load_policy
from rlaif.models.packing import enable_packing

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PolicyWithValue(nn.Module):
    """The policy LM plus a scalar value head on its last hidden state (one backbone pass for both). Its forward gives
    the response tokens' log-probs at the sampling temperature, their entropy (no gradient) and the values."""

    def __init__(self, lm: nn.Module, hidden_size: int, temperature: float):
        super().__init__()
        self.lm, self.temperature = lm, temperature
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, prompt_ids, prompt_mask, responses, resp_mask):
        logprobs, entropy, hidden = response_logprobs(self.lm, prompt_ids, prompt_mask, responses, resp_mask,
                                                      self.temperature, want_hidden=True)
        return logprobs, entropy, self.value_head(hidden).squeeze(-1)

    def from_hidden(self, hidden, responses):
        """(log-probs, values) of the responses from the last hidden states that predicted them, as the sampler
        computed them (ppo.rollout_logprobs): the output layer and the value head, no backbone pass."""
        _, head = backbone_and_head(self.lm)
        logprobs, _ = chosen_logprobs(hidden, head.weight, head.bias, responses, self.temperature)
        return logprobs, self.value_head(hidden).squeeze(-1)


def build_policy(cfg, device):
    """(tokenizer, trainable PolicyWithValue, reference_logprobs(policy, *inputs)). LoRA: the reference is the
    adapter disabled; all weights: a frozen copy. None where nothing reads the reference: a KL weight of 0 that does
    not adapt."""
    settings = cfg.ppo
    tokenizer, lm = load_policy(cfg.policy)
    enable_packing(lm)  # forwards over real tokens only, where the architecture allows (the reference copy too)
    fuse(lm, device)  # fused element-wise kernels on CPUs (the reference copy too)
    torch.manual_seed(cfg.seed)  # the same adapter and value-head initialisation whether or not the policy was cached
    needs_reference, reference_logprobs = settings.kl_coef > 0 or settings.adaptive_kl_target is not None, None
    if settings.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        names = [name for name, _ in lm.named_modules()]
        # Llama-family layer names where the model has them all (the set peers configure); else, for other
        # architectures (GPT-2's c_attn, GPT-NeoX's query_key_value), every linear layer but the output layer.
        targets = (LORA_TARGETS if all(any(n == t or n.endswith("." + t) for n in names) for t in LORA_TARGETS)
                   else "all-linear")
        lm = get_peft_model(lm, LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                                           target_modules=targets, fan_in_fan_out=stores_weights_transposed(lm)))

        def adapter_disabled_logprobs(policy, *args):
            with policy.lm.disable_adapter():  # of the policy given: the learner's or the async actor's copy
                return response_logprobs(policy.lm, *args, settings.temperature)[0]

        reference_logprobs = adapter_disabled_logprobs if needs_reference else None
    elif needs_reference:
        frozen = copy.deepcopy(lm).eval().requires_grad_(False).to(device)

        def frozen_copy_logprobs(policy, *args):
            return response_logprobs(frozen, *args, settings.temperature)[0]

        reference_logprobs = frozen_copy_logprobs

    policy = PolicyWithValue(lm, lm.config.hidden_size, settings.temperature).to(device)
    if settings.algorithm == "grpo":
        policy.value_head.requires_grad_(False)  # no critic: advantages come from the group
    return tokenizer, policy, reference_logprobs
