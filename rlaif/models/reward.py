"""The preference (reward) model: loading a sequence-classification model with one score, batched scoring, and the
normalised scorer that PPO and the evaluation share (mean and std from the reward_stats.json train_rm exports)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def load_reward_model(path: Path, lora_rank: int = 0, lora_alpha: int = 32):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, use_safetensors=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=lora_rank, lora_alpha=lora_alpha,
                                                 target_modules="all-linear"))
    # A pairwise loss sees only r(a) - r(b): the score head's bias gets no true gradient, and Adam would turn the
    # rounding noise in it into lr-sized steps. It stays at its initial value.
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features == 1 and module.bias is not None:
            module.bias.requires_grad_(False)
    return tokenizer, model


def reward(model, tokenizer, prompts: list[str], responses: list[str], max_length: int, device) -> torch.Tensor:
    enc = tokenizer(prompts, responses, padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt").to(device)
    return model(**enc).logits.squeeze(-1)


@torch.no_grad()
def batched_rewards(model, tokenizer, prompts, responses, max_length, device, batch_size=64) -> torch.Tensor:
    model.eval()
    out = [reward(model, tokenizer, prompts[i : i + batch_size], responses[i : i + batch_size], max_length, device)
           for i in range(0, len(prompts), batch_size)]
    return torch.cat(out).float().cpu() if out else torch.zeros(0)


def normalised_scorer(path: Path, device):
    """score(prompts, responses) -> the exported reward model's scores, normalised by its training mean and std."""
    tokenizer, model = load_reward_model(path)
    model.to(device).eval().requires_grad_(False)
    stats = json.loads((path / "reward_stats.json").read_text())

    def score(prompts: list[str], responses: list[str]) -> torch.Tensor:
        raw = batched_rewards(model, tokenizer, prompts, responses, stats["max_length"], device)
        return (raw - stats["mean"]) / max(stats["std"], 1e-6)

    return score
