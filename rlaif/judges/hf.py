"""Hugging Face causal-LM judge, the RLAIF method (Lee et al. 2023).

Pairwise: the prompt (preamble, one sampled principle, optional worked examples, the request and both responses)
ends with "Preferred response:"; the label is the softmax over the next-token logits of " 1" and " 2", i.e.
P(first better) as a probability. With chain of thought, a greedy rationale comes first and the answer is read
after it. Direct score (d-RLAIF): the expectation of the score over " 1/10" ... " 10/10", each scored as a whole
continuation, rescaled from [1, 10] to [-1, 1].
"""
from __future__ import annotations

import math

import torch

from rlaif.config.judges import SHORTEST_JUDGE_INPUT
from rlaif.distributed import local_device
from rlaif.errors import UserError
from rlaif.judges import prompting
from rlaif.models.generation import (
    decode,
    next_token_logprobs,
    response_logits_and_hidden,
    response_mask,
    sample,
    stop_ids,
    token_logprobs,
)
from rlaif.models.loading import config_position_limit, load_causal_lm, load_tokenizer, resolve, with_model_stops
from rlaif.models.prompt_text import leading_bos, prompt_token_ids


def answer_token(tokenizer, cue: str, answer: str) -> int:
    """The single token that follows `cue` when the text continues with `answer`; a clear error when there is none."""
    base = tokenizer(cue, add_special_tokens=False).input_ids
    full = tokenizer(cue + answer, add_special_tokens=False).input_ids
    extra = full[len(base):]
    if full[: len(base)] != base or len(extra) != 1 or extra[0] == tokenizer.unk_token_id \
            or tokenizer.decode(extra).strip() != answer.strip():
        raise UserError(f"the judge's tokenizer has no single token for the answer {answer.strip()!r} after "
                        f"{cue.strip()!r}: use a judge model whose tokenizer has one (most chat LMs do)")
    return extra[0]


def judge_positions(settings, path) -> int | None:
    """The judge model's positions (None where its config names no limit): its inputs are cut to fit them, less the
    rationale's tokens (chain of thought), so a model shorter than hf.max_length neither indexes past its learned
    position embeddings (GPT-2) nor reads text longer than it was trained on (rotary)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=settings.hf.trust_remote_code)
    limit = config_position_limit(config)
    rationale = settings.rationale_tokens if settings.chain_of_thought else 0
    if limit is not None and limit - rationale < SHORTEST_JUDGE_INPUT:
        raise UserError(f"{settings.setting}.rationale_tokens={rationale} leaves the judge model's {limit} positions "
                        f"less than {SHORTEST_JUDGE_INPUT} tokens for its input ({path}): lower it")
    return limit


def check_answer_tokens(path, trust_remote_code: bool) -> None:
    """Before any work (launch's model checks): the judge's tokenizer has the answer tokens the judge reads."""
    tokenizer = load_tokenizer(path, trust_remote_code, padding_side="left")
    for answer in prompting.ANSWERS:
        answer_token(tokenizer, prompting.ANSWER_CUE, answer)


def answer_probability(answer_logprobs: torch.Tensor) -> torch.Tensor:
    """P(first better) from the log-probs of the answers " 1" and " 2" ([batch, 2], float32), renormalised over the
    two; in-process and served judging both end here, from the same float32 log-probs."""
    return torch.softmax(answer_logprobs, dim=-1)[:, 0]


def served_judge(hf, setting: str = "label.hf"):
    """A client of the judge service, once it is known to serve this judge model (`setting`: where `hf` lives)."""
    from rlaif.serving.client import ServiceClient
    from rlaif.serving.identity import check_service, judge_digest

    client = ServiceClient(hf.endpoint, f"{setting}.endpoint")
    info = check_service(client, "judge", judge_digest(hf), "transformers")
    if "logprob_token_ids" not in info.get("extensions", ()):  # before any work, not at the first batch
        raise UserError(f"{client.base_url} does not return a judge's exact answer log-probs (an `rlaif serve` older "
                        "than this rlaif): redeploy the judge service with this rlaif version")
    return client


def answer_logprobs(choice: dict, answer_ids: list[int]) -> list[float]:
    """The answers' exact log-probs from a served choice (asked for by id, returned among its top log-probs whatever
    their rank): the in-process judge's values, never a bound from the top-k."""
    try:
        top = {int(tid): float(lp) for tid, lp in choice["logprobs"]["top_token_ids"][0]}
        if not top or any(math.isnan(lp) or lp > 1e-6 for lp in top.values()):
            raise ValueError("no log-probabilities")
    except (KeyError, IndexError, TypeError, ValueError):
        raise UserError(f"the judge service returned no token-id log-probs ({str(choice)[:120]}): serve the judge "
                        "with `rlaif serve --set serve.model=judge`") from None
    if not all(a in top for a in answer_ids):
        raise UserError("the judge service did not return the answers' own log-probs (an `rlaif serve` older than "
                        "this rlaif?): serve the judge with this version's `rlaif serve --set serve.model=judge`")
    return [top[a] for a in answer_ids]


class HFJudge:
    """In this process, or (label.hf.endpoint) through an `rlaif serve` service of the same model: each prompt is sent
    padded as its in-process batch pads it, and the service returns the log-probs computed here, so the labels are the
    same whichever replica answers."""

    def __init__(self, settings, batch_size: int):
        if not settings.hf.model:
            raise UserError(f"judge 'hf' needs a model: set {settings.setting}.hf.model to a Hugging Face causal-LM "
                            "directory")
        path = resolve(settings.hf.model, "judge model")
        self.name = f"hf:{path.name}"
        self.settings = settings
        self.batch_size = batch_size
        self.max_length = settings.hf.max_length
        self.positions = judge_positions(settings, path)
        tokenizer = load_tokenizer(path, settings.hf.trust_remote_code, padding_side="left")
        self.tokenizer = with_model_stops(tokenizer, path)  # a score-mode continuation ends where the model's does
        self.bos = [bos] if (bos := leading_bos(self.tokenizer)) is not None else []  # put back on a cut prompt
        self.device = local_device()
        self.client = self.model = None
        if settings.hf.endpoint.base_url:
            self.client = served_judge(settings.hf, f"{settings.setting}.hf")
            self.stats = self.client.stats
        else:
            self.model = load_causal_lm(path, settings.hf.trust_remote_code, "judge model").eval().to(self.device)
        self.answer_ids = [answer_token(self.tokenizer, prompting.ANSWER_CUE, a) for a in prompting.ANSWERS]
        self.examples = prompting.load_few_shot(settings.few_shot)

    def _encode(self, texts: list[str], room: int = 0) -> dict:
        """Left-padded judge prompts, BOS first where the judge's tokenizer starts with one (as the policy's prompts,
        prompt_text.prompt_token_ids); one longer than hf.max_length, or than the judge model's positions less the
        `room` for what follows it (a rationale, a score's tokens), loses its start, keeping the question and the
        answer cue at its end (and its BOS)."""
        longest = self.max_length if self.positions is None else min(self.max_length, self.positions - room)
        rows = [row if len(row) <= longest else self.bos + row[len(row) - longest + len(self.bos):]
                for row in prompt_token_ids(self.tokenizer, texts)]
        enc = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        return {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}

    def _served(self, enc: dict, **request) -> list[dict]:
        """One request per row of the batch `enc`, its padding named, so the service pads it as this batch does."""
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        width = enc["input_ids"].shape[1]
        return [r["choices"][0] for r in self.client.completions(
            [{"prompt": row, "pad_to_tokens": width, "temperature": 0, **request} for row in rows])]

    @torch.no_grad()
    def _rationales(self, texts: list[str]) -> list[str]:
        enc = self._encode(texts, room=self.settings.rationale_tokens)
        if self.client:
            text = [c["text"] for c in self._served(enc, max_tokens=self.settings.rationale_tokens, seed=0)]
        else:
            out = sample(self.model, self.tokenizer, enc, max_new_tokens=self.settings.rationale_tokens,
                         temperature=0.0)
            text = decode(self.tokenizer, out, response_mask(out, stop_ids(self.tokenizer)))
        return [t.split(prompting.ANSWER_CUE.strip())[0] for t in text]  # a rationale that runs on into an answer stops

    @torch.no_grad()
    def _p_first(self, texts: list[str]) -> torch.Tensor:
        enc = self._encode(texts)
        if self.client:
            choices = self._served(enc, max_tokens=1, logprobs=1, logprob_token_ids=self.answer_ids)
            return answer_probability(torch.tensor([answer_logprobs(c, self.answer_ids) for c in choices],
                                                   dtype=torch.float32))
        logprobs = next_token_logprobs(self.model, enc)  # left padding: the last position is the answer cue
        return answer_probability(logprobs[:, self.answer_ids]).cpu()

    def prefer_first(self, prompts, first, second, principles) -> torch.Tensor:
        s = self.settings
        out = []
        for i in range(0, len(prompts), self.batch_size):
            sl = slice(i, i + self.batch_size)
            texts = [prompting.pairwise_prompt(s.preamble, pr, self.examples, p, a, b, s.chain_of_thought)
                     for p, a, b, pr in zip(prompts[sl], first[sl], second[sl], principles[sl])]
            if s.chain_of_thought:
                texts = [prompting.after_rationale(t, r) for t, r in zip(texts, self._rationales(texts))]
            out.append(self._p_first(texts))
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def direct_score(self, prompts, responses, principles) -> torch.Tensor:
        """Expected 1-10 score under the judge, rescaled to [-1, 1]."""
        if self.client:
            raise UserError("score mode reads whole continuations, which the judge service does not return: run the "
                            "judge in-process (empty label.hf.endpoint.base_url) or use label.mode=pairwise")
        candidates = [self.tokenizer(prompting.score_candidate(k), add_special_tokens=False).input_ids
                      for k in prompting.SCORES]
        width = max(map(len, candidates))
        cand_ids = torch.full((len(candidates), width), self.tokenizer.pad_token_id, dtype=torch.long)
        cand_mask = torch.zeros_like(cand_ids)
        for k, ids in enumerate(candidates):
            cand_ids[k, : len(ids)] = torch.tensor(ids)
            cand_mask[k, : len(ids)] = 1
        values = torch.tensor(prompting.SCORES, dtype=torch.float32)
        n_cand = len(candidates)
        out = []
        step = max(1, self.batch_size // n_cand)
        for i in range(0, len(prompts), step):
            texts = [prompting.score_prompt(self.settings.preamble, pr, p, r)
                     for p, r, pr in zip(prompts[i : i + step], responses[i : i + step], principles[i : i + step])]
            enc = self._encode(texts, room=width)
            rows = len(texts)
            ids = enc["input_ids"].repeat_interleave(n_cand, 0)
            mask = enc["attention_mask"].repeat_interleave(n_cand, 0)
            c_ids, c_mask = cand_ids.repeat(rows, 1).to(self.device), cand_mask.repeat(rows, 1).to(self.device)
            logits, _ = response_logits_and_hidden(self.model, ids, mask, c_ids, c_mask)
            logp = (token_logprobs(logits, c_ids) * c_mask).sum(1).view(rows, n_cand).cpu()
            expected = (torch.softmax(logp, dim=-1) * values).sum(-1)
            out.append((expected - 5.5) / 4.5)
        return torch.cat(out) if out else torch.zeros(0)
