"""The preference (reward) model: loading a sequence-classification model with one score, batched scoring, and the
normalised scorer that PPO and the evaluation share (mean and std from the reward_stats.json train_rm exports)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rlaif.errors import UserError
from rlaif.models.adapters import stores_weights_transposed
from rlaif.models.cpu_kernels import fuse
from rlaif.models.loading import check_match, float32_weights, load_tokenizer, refused_if_unloadable
from rlaif.models.packing import enable_packing, packed_scores


def load_reward_model(path: Path, lora_rank: int = 0, lora_alpha: int = 32):
    """(tokenizer, sequence classifier with one score) from a backbone or an exported reward model. A classifier
    saved with another number of labels gets a fresh one-score head, as an encoder or a causal LM does."""
    from transformers import AutoModelForSequenceClassification

    # Right padding: the positions a classifier counts from column 0 are each row's own (a left-padded row of a model
    # with learned absolute positions, GPT-2, would be scored by the longest row of its batch).
    tokenizer = load_tokenizer(path, padding_side="right")
    tokenizer.truncation_side = "right"  # as pair_inputs truncates the policy's token ids: both keep the starts
    with refused_if_unloadable(path, "reward model"):
        model, loaded = AutoModelForSequenceClassification.from_pretrained(str(path), use_safetensors=True,
                                                                           num_labels=1, ignore_mismatched_sizes=True,
                                                                           output_loading_info=True,
                                                                           **float32_weights())
    # Only the head may be replaced (fresh, one score); a backbone tensor that does not fit its config is an error.
    backbone = {key for key, *_ in loaded["mismatched_keys"] if key.startswith(model.base_model_prefix + ".")}
    if backbone:
        raise UserError(f"the weights in {path} do not fit its config.json ({', '.join(sorted(backbone)[:3])}): "
                        "re-export the model with save_pretrained")
    check_match(tokenizer, model.get_input_embeddings().num_embeddings, path)
    if hasattr(model, "score"):
        # A decoder's classifier (its head is `score`) pools each row's rightmost token that is not the text config's
        # pad_token_id: it must be the id the tokenizer pads with (a config naming another id, or a tokenizer padding
        # with its EOS, would pool a padding token). An encoder pools its first token, and its pad id also places
        # its positions (RoBERTa): left as saved.
        model.config.pad_token_id = model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=lora_rank, lora_alpha=lora_alpha,
                                                 target_modules="all-linear",
                                                 fan_in_fan_out=stores_weights_transposed(model)))
    # A pairwise loss sees only r(a) - r(b): the score head's bias gets no true gradient, and Adam would turn the
    # rounding noise in it into lr-sized steps. It stays at its initial value.
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features == 1 and module.bias is not None:
            module.bias.requires_grad_(False)
    return tokenizer, model


def reward(model, tokenizer, prompts: list[str], responses: list[str], max_length: int, device) -> torch.Tensor:
    enc = tokenizer(prompts, responses, padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt").to(device)
    return classifier_scores(model, enc).squeeze(-1)


def classifier_scores(model, enc: dict) -> torch.Tensor:
    """The classifier's logits [rows, labels]: a forward over the real tokens only where the model packs
    (NormalisedScorer switches it on), else the plain padded forward."""
    packed = packed_scores(model, enc["input_ids"], enc["attention_mask"])
    return packed if packed is not None else model(**enc).logits


@torch.no_grad()
def batched_rewards(model, tokenizer, prompts, responses, max_length, device, batch_size=64) -> torch.Tensor:
    model.eval()
    out = [reward(model, tokenizer, prompts[i : i + batch_size], responses[i : i + batch_size], max_length, device)
           for i in range(0, len(prompts), batch_size)]
    return torch.cat(out).float().cpu() if out else torch.zeros(0)


class NormalisedScorer:
    """The exported reward model's scores normalised by its training mean and std (reward_stats.json), as PPO and
    the evaluation score: on text
    (prompts, responses), or with `token_ids` set, on the policy's sampled response tokens (`score_tokens`): no
    decode and re-tokenize, for a reward model whose tokenizer is the policy's (`shares_tokenizer`)."""

    def __init__(self, path: Path, device):
        self.tokenizer, self.model = load_reward_model(path)
        self.model.to(device).eval().requires_grad_(False)
        enable_packing(self.model)  # scores from forwards over the real tokens only, where the architecture allows
        fuse(self.model, device)  # fused element-wise kernels on CPUs
        stats = json.loads((path / "reward_stats.json").read_text())
        self.mean, self.std, self.max_length = stats["mean"], max(stats["std"], 1e-6), stats["max_length"]
        self.device, self.token_ids = device, False

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        raw = batched_rewards(self.model, self.tokenizer, prompts, responses, self.max_length, self.device)
        return (raw - self.mean) / self.std

    def shares_tokenizer(self, tokenizer) -> bool:
        """Same vocabulary, normalisation, pre-tokenization and added tokens (fast tokenizers only): the policy's
        token ids mean the same text to the reward model."""
        mine = tokenizer_identity(self.tokenizer)
        return mine is not None and mine == tokenizer_identity(tokenizer)

    @torch.no_grad()
    def score_tokens(self, prompts: list[str], responses: torch.Tensor, mask: torch.Tensor,
                     batch_size: int = 64) -> torch.Tensor:
        """Scores of (prompt text, response token ids [rows, T] where mask is 1, special tokens dropped as decoding
        drops them) in the reward model's own pair template, truncated as its tokenizer truncates text pairs."""
        special = torch.tensor(self.tokenizer.all_special_ids, dtype=responses.dtype)
        responses, mask = responses.cpu(), mask.cpu()
        # Ids past the tokenizer (a policy's embedding rows padded beyond its vocabulary) decode to nothing too.
        keep = mask.bool() & ~torch.isin(responses, special) & (responses < len(self.tokenizer))
        rows = [row[k].tolist() for row, k in zip(responses, keep)]
        out = []
        for i in range(0, len(rows), batch_size):
            enc = pair_inputs(self.tokenizer, prompts[i : i + batch_size], rows[i : i + batch_size], self.max_length)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            out.append(classifier_scores(self.model, enc).squeeze(-1).float().cpu())
        raw = torch.cat(out) if out else torch.zeros(0)
        return (raw - self.mean) / self.std


TOKEN_IDS_NEED_ONE_TOKENIZER = ("ppo.reward_inputs=token_ids needs the reward model's tokenizer to be the policy's "
                                "(same vocabulary, normalisation and added tokens): set ppo.reward_inputs to text or "
                                "auto")


def reward_scorer(path: Path, reward_inputs: str, tokenizer, device) -> NormalisedScorer:
    """PPO's scorer: the normalised reward model, fed the policy's token ids or text as ppo.reward_inputs says."""
    scorer = NormalisedScorer(path, device)
    shared = scorer.shares_tokenizer(tokenizer)
    if reward_inputs == "token_ids" and not shared:
        raise UserError(TOKEN_IDS_NEED_ONE_TOKENIZER)
    scorer.token_ids = shared and reward_inputs != "text"
    return scorer


def check_one_tokenizer(policy_tokenizer, backbone: Path) -> None:
    """Before any work, for ppo.reward_inputs=token_ids: the reward model keeps its backbone's tokenizer, so the
    backbone's must be the policy's (else the refusal would come only after train_rm)."""
    mine = tokenizer_identity(load_tokenizer(backbone, padding_side=None))
    if mine is None or mine != tokenizer_identity(policy_tokenizer):
        raise UserError(TOKEN_IDS_NEED_ONE_TOKENIZER)


def tokenizer_identity(tokenizer) -> dict | None:
    """What decides how a fast tokenizer maps text to ids (its model, normaliser, pre-tokenizer, added tokens), or
    None for a tokenizer without a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    return {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}


PLACEHOLDER = "x"  # a second sequence whose positions show where the pair template puts the response


def pair_inputs(tokenizer, prompts: list[str], responses: list[list[int]], max_length: int) -> dict:
    """Model inputs for (prompt text, response ids) pairs, padded by the tokenizer: its pair template around the
    prompt and a placeholder, whose positions take the response ids, truncated as text pairs are (longest_first)."""
    enc = tokenizer(prompts, [PLACEHOLDER] * len(prompts), add_special_tokens=True)
    rows = []
    for i, response in enumerate(responses):
        sequence, ids = enc.sequence_ids(i), enc["input_ids"][i]
        types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(ids)
        prompt = [t for t, s in zip(ids, sequence) if s == 0]
        keep_prompt, keep_response = longest_first(len(prompt), len(response), max_length - sequence.count(None))
        parts = {0: prompt[:keep_prompt], 1: list(response)[:keep_response]}
        row = {"input_ids": [], "token_type_ids": []}
        placed = set()
        for token, kind, segment in zip(ids, types, sequence):
            if segment in placed:
                continue
            part = [token] if segment is None else parts[segment]
            if segment is not None:
                placed.add(segment)
            row["input_ids"] += part
            row["token_type_ids"] += [kind] * len(part)
        rows.append(row)
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    return dict(tokenizer.pad({k: [row[k] for row in rows] for k in keys}, return_tensors="pt"))


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """The lengths `tokenizers` keeps of a pair under truncation="longest_first" (its truncate_encodings): the longer
    is cut to what the shorter leaves, or, when that is not enough, each gets half (the longer the odd token)."""
    budget = max(budget, 0)
    if first + second <= budget:
        return first, second
    short = min(first, second)
    kept_short, kept_long = short, short if short > budget else max(short, budget - short)
    if kept_short + kept_long > budget:
        kept_short, kept_long = budget // 2, budget // 2 + budget % 2
    return (kept_long, kept_short) if first > second else (kept_short, kept_long)
