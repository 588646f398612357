"""Embedding judge: the offline default labeler.

A pretrained sentence encoder (all-MiniLM-L6-v2) scores a response by its cosine similarity to the principle minus
its similarity to the principle's contrast (the response the principle argues against), plus, weighted, its
similarity to the prompt (on-topic answers). The soft label for "first response better" is
sigmoid((score_first - score_second) / temperature).

Why the contrast: a short generic reply ("Maybe do X. It depends.", "Whatever.") sits closer to any abstract
principle sentence than a long concrete answer does, so similarity to the principle alone ranks hedges and rude
one-liners above good answers (measured: 0.33 agreement with the demo data's quality tiers). The generic closeness is
shared by the principle and its contrast and cancels in the difference (0.97 with the contrast, principle ensemble and
relevance 0.5; BENCHMARKS.md, "AI judge").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlaif.distributed import local_device
from rlaif.models.loading import float32_weights, load_tokenizer, refused_if_unloadable, resolve


class EmbeddingJudge:
    name = "embedding:all-MiniLM-L6-v2"

    def __init__(self, temperature: float, relevance_weight: float, batch_size: int = 64,
                 backbone: str = "builtin:minilm", contrasts: dict[str, str] | None = None):
        from transformers import AutoModel

        path = resolve(backbone, "embedding judge backbone")
        # Right padding: positions from column 0 are each text's own (an encoder's positions are learned).
        self.tokenizer = load_tokenizer(path, padding_side="right")
        self.device = local_device()
        with refused_if_unloadable(path, "embedding judge backbone"):
            self.model = AutoModel.from_pretrained(str(path), use_safetensors=True, **float32_weights()).eval()
        self.model.to(self.device)
        self.temperature = temperature
        self.relevance_weight = relevance_weight
        self.batch_size = batch_size
        self.contrasts = contrasts or {}  # principle text -> contrast text
        self._cache: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """Mean-pooled, L2-normalised embeddings; repeated texts (prompts, principles) are embedded once."""
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for i in range(0, len(missing), self.batch_size):
            chunk = missing[i : i + self.batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=128,
                                 return_tensors="pt").to(self.device)
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0), dim=-1)
            for text, vec in zip(chunk, pooled):
                self._cache[text] = vec
        if len(self._cache) > 50_000:  # responses rarely repeat: keep the cache from growing without bound
            keep = set(texts)
            self._cache = {k: v for k, v in self._cache.items() if k in keep}
        return torch.stack([self._cache[t] for t in texts])

    def score(self, prompts: list[str], responses: list[str], principles: list[str]) -> torch.Tensor:
        r = self.embed(responses)
        principle_sim = (r * self.embed(principles)).sum(-1)
        with_contrast = [i for i, p in enumerate(principles) if p in self.contrasts]
        if with_contrast:
            contrast = self.embed([self.contrasts[principles[i]] for i in with_contrast])
            principle_sim[with_contrast] -= (r[with_contrast] * contrast).sum(-1)
        prompt_sim = (r * self.embed(prompts)).sum(-1)
        return principle_sim + self.relevance_weight * prompt_sim

    def prefer_first(self, prompts: list[str], first: list[str], second: list[str],
                     principles: list[str]) -> torch.Tensor:
        """P(first response is better), one comparison in the order given."""
        s1 = self.score(prompts, first, principles)
        s2 = self.score(prompts, second, principles)
        return torch.sigmoid((s1 - s2) / self.temperature).cpu()
