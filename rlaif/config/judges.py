"""Judge settings, shared by the label stage (its judge) and the evaluation's further judges."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlaif.config.base import Location, Phrase, Strict, described, runtime_field, service_url, without
from rlaif.config.serving import ServiceEndpoint

DEFAULT_PREAMBLE = ("You compare two responses to a request. A better response follows the principle below more "
                    "closely, and answers the request.")


SHORTEST_JUDGE_INPUT = 16  # tokens: hf.max_length's floor, and the least room a judge model's positions must leave


class HFJudgeConfig(Strict):
    model: Location = ""
    """The judge: a Hugging Face causal-LM directory (local path or s3:// URL). Required for judge `hf`."""
    max_length: int = Field(1024, ge=SHORTEST_JUDGE_INPUT, le=1_000_000)
    """Longest judge input in tokens, and never more than the judge model's positions (less the rationale's tokens
    with chain of thought); longer inputs lose their beginning (the question at the end is kept)."""
    trust_remote_code: bool = False
    """Allow the judge directory's own Python code to run."""
    endpoint: ServiceEndpoint = runtime_field(ServiceEndpoint())
    """Where the judge runs: empty base_url: in this process; else an `rlaif serve` service of this same model (serve
    model judge), which returns the log-probs this judge reads, batch by batch: the labels are the in-process ones
    (not part of the cache key). Pairwise mode."""


class OpenAIJudgeConfig(Strict):
    base_url: str = ""
    """An OpenAI-compatible API root, e.g. `http://vllm:8000/v1` (vLLM, TGI, llama.cpp server, a hosted API)."""

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return service_url(v, "http://vllm:8000/v1")
    model: Location = ""
    """Model name sent with each request."""
    api: Literal["completions", "chat"] = "completions"
    """`completions` (/completions with a prompt; log-probs of the answer token) or `chat` (/chat/completions)."""
    api_key_env: str = runtime_field("RLAIF_JUDGE_API_KEY")
    """Name of the environment variable holding the API key (never the key itself: keys do not go in configs); the
    cluster's `rlaif-judge` secret fills RLAIF_JUDGE_API_KEY. A launch refuses when it is set and the variable is
    not; empty: send no key (a server without authentication, e.g. your own vLLM)."""
    concurrency: int = runtime_field(16, ge=1, le=4096)
    """Requests in flight at once. This and the other settings of how the endpoint is called (api_key_env,
    timeout_s, max_retries, backoff_s) are not part of label's cache key: the pairs are judged and written alike."""
    timeout_s: float = runtime_field(60.0, gt=0, le=86400)
    """Seconds before a request is abandoned and retried."""
    max_retries: int = runtime_field(5, ge=0, le=100)
    """Retries of a request after a timeout, a connection error, 429 or 5xx (exponential backoff, Retry-After)."""
    backoff_s: float = runtime_field(1.0, ge=0, le=600)
    """First retry delay; doubles per retry (at most 10 minutes), with jitter."""
    top_logprobs: int = Field(5, ge=2, le=20)
    """Log-probs asked for per token (at least 2: both answers' odds); the answer's probabilities come from these
    when the server returns them."""
    max_unreadable_fraction: float = Field(0.1, ge=0, le=1)
    """The most of the judge's answers that may be neither 1 nor 2 (each labelled 0.5, a tie) before the stage stops:
    a model that answers something else is not judging (checked from the 50th answer on; a judge that reads none of
    its first 8 answers stops whatever this is)."""


class RulesJudgeConfig(Strict):
    """Deterministic checks; a response's score is the fraction of checks it passes."""

    min_words: int = Field(1, ge=0, le=100_000)
    """A response shorter than this fails the length check."""
    max_words: int | None = Field(None, ge=1, le=100_000)
    """A response longer than this fails the length check (None: no upper bound)."""
    required: list[Phrase] = []
    """Keywords (case-insensitive) of which each present passes one check."""
    forbidden: list[Phrase] = []
    """Keywords (case-insensitive) of which each absent passes one check."""
    pattern: str | None = None
    """Regular expression the response must contain (re.search) to pass the format check."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                compiled = re.compile(v)
            except re.error as exc:
                raise ValueError(f"is not a valid regular expression: {exc}") from None
            if compiled.search(""):
                raise ValueError(f"{v!r} matches the empty string, so every response passes it: give a pattern "
                                 "that needs something, or leave it out")
        return v

    @model_validator(mode="after")
    def _length_range(self):
        if self.max_words is not None and self.min_words > self.max_words:
            raise ValueError(f"min_words={self.min_words} is above max_words={self.max_words}: no response could "
                             "pass the length check")
        return self


DEFAULT_RUDE_TERMS = ["stupid", "idiot", "dumb", "shut up", "figure it out yourself", "look it up", "ask someone else",
                      "stop asking", "whatever", "obvious", "don't know", "not my problem", "go away", "waste of time"]


class ReferenceJudgeConfig(Strict):
    """The `reference` judge: key-point coverage minus penalties for rules a program can check."""

    min_point_overlap: float = Field(0.5, gt=0.0, le=1.0)
    """A key point counts as covered when the response holds at least this fraction of its content words."""
    rude_terms: list[Phrase] = DEFAULT_RUDE_TERMS
    """Phrases (case-insensitive, whole words) that make a response rude."""
    rude_penalty: float = Field(1.0, ge=0.0, le=2.0)
    """Subtracted from the score of a rude response."""
    off_topic_penalty: float = Field(1.0, ge=0.0, le=2.0)
    """Subtracted from the score of a response sharing no content word with the prompt or its key points."""


class JudgeSettings(Strict):
    judge: Literal["embedding", "hf", "openai", "rules", "reference"] = "embedding"
    """The AI labeler. `embedding`: the pretrained MiniLM scores each response by its similarity to the principle
    (minus its similarity to the principle's contrast) and to the prompt. `hf`: a causal LM judge (RLAIF, Lee et al.
    2023): the preference is read from the log-probabilities of the answer tokens "1" and "2". `openai`: the same
    prompt sent to an OpenAI-compatible endpoint. `rules`: deterministic checks (see `rules`). `reference`: not an AI
    judge but a verifiable grader of key-point coverage against references in the prompts file (see `reference`);
    the evaluation adds it by itself wherever the held-out prompts carry references."""
    constitution: Location = "data/constitution.yaml"
    """YAML list of principles {name, text, contrast?} (Constitutional AI); `contrast` describes the response the
    principle argues against. '' for the rules and reference judges, which read no principles."""
    principles: Literal["sample", "all"] = "sample"
    """`sample`: one principle per comparison, seeded by the pair (Constitutional AI). `all`: every principle judges
    every comparison and the preferences are averaged (an ensemble: k times the judge calls, less label noise)."""
    temperature: float = Field(0.05, ge=1e-4, le=100)
    """Soft-label temperature of the score-based judges (embedding, rules, reference) and of label.mode=score with
    any judge: p(a) = sigmoid((s_a - s_b) / temperature). Unread (and out of the cache key) otherwise."""
    relevance_weight: float = Field(0.5, ge=0, le=10)
    """Weight of response-prompt similarity in the embedding judge's score."""
    preamble: str = DEFAULT_PREAMBLE
    """LLM judges (hf, openai): the instruction at the top of every judge prompt."""
    chain_of_thought: bool = False
    """LLM judges: the judge writes a rationale first (greedy), then the answer is read after it."""
    rationale_tokens: int = Field(64, ge=1, le=32768)
    """LLM judges: longest rationale with chain_of_thought."""
    few_shot: Location | None = None
    """LLM judges: JSONL of worked examples {prompt, response_1, response_2, preferred: 1 or 2, rationale?} shown
    before each comparison."""
    hf: HFJudgeConfig = HFJudgeConfig()
    """Settings of the `hf` judge."""
    openai: OpenAIJudgeConfig = OpenAIJudgeConfig()
    """Settings of the `openai` judge."""
    rules: RulesJudgeConfig = RulesJudgeConfig()
    """Settings of the `rules` judge."""
    reference: ReferenceJudgeConfig = ReferenceJudgeConfig()
    """Settings of the `reference` judge."""

    @model_validator(mode="after")
    def _llm_settings_need_an_llm_judge(self):
        """A few-shot file or a rationale under a judge that reads neither would be keyed and checked, never used."""
        if self.judge not in ("hf", "openai"):
            fields = type(self).model_fields
            ignored = [name for name in ("preamble", "chain_of_thought", "rationale_tokens", "few_shot")
                       if getattr(self, name) != fields[name].default]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} read by the LLM "
                                 f"judges (hf, openai) only, not by judge {self.judge}: remove "
                                 f"{'it' if len(ignored) == 1 else 'them'} or set judge to hf or openai")
        return self

    def cache_key_view(self, keyed: dict) -> dict:
        """Another judge's section (hf, openai, rules), the embedding judge's weight and the score-based judges'
        temperature are left out where this judge never reads them, so a config may keep them while switching
        judges. (label's `reference` stays: label and train_rm grade against references whatever the judge, and
        evaluate's added reference judge takes label's.)"""
        unread = {"hf", "openai", "rules"} - {self.judge}
        unread |= {"relevance_weight"} if self.judge != "embedding" else set()
        unread |= set() if self.reads_temperature else {"temperature"}
        return without(keyed, unread)

    @property
    def reads_temperature(self) -> bool:
        """The soft-label temperature applies to score differences: an hf or openai judge compares a pair by the
        model's own answer."""
        return self.judge not in ("hf", "openai")

    @property
    def setting(self) -> str:
        """Where these settings live in the config, for errors (label's; an evaluation judge's says its name)."""
        return "label"

    @property
    def reads_constitution(self) -> bool:
        """Whether the constitution setting is read at all (label's is, to sample the principles its labels record,
        whatever the judge)."""
        return True

    @property
    def pod_judge(self) -> str:
        """This judge as the pod plan sees it: `served` for an hf judge whose model runs in a service (the label pod
        then needs no GPU), else the judge's name."""
        return "served" if self.judge == "hf" and self.hf.endpoint.base_url else self.judge


class JudgeSpec(JudgeSettings):
    """A further judge used by the evaluation (the training judge, `label`'s, is always first, named `training`)."""

    name: str = Field(min_length=1, max_length=64, pattern=described(r"^[A-Za-z0-9_-]+$", "letters, digits, '-' "
                                                                                        "and '_'"))
    """Name shown in the report, e.g. `heldout` (letters, digits, '-', '_')."""

    @property
    def setting(self) -> str:
        """Where this judge's settings live in the config, for errors: the training judge's are label's."""
        return "label" if self.name == "training" else f"evaluate.judges[{self.name}]"

    @property
    def reads_constitution(self) -> bool:
        """An evaluation's reference judge grades key points and reads no constitution."""
        return self.judge != "reference"

    def cache_key_view(self, keyed: dict) -> dict:
        """As label's, and an evaluation judge reads its `reference` section only as the reference judge."""
        keyed = super().cache_key_view(keyed)
        keyed = keyed if self.judge == "reference" else without(keyed, {"reference"})
        return keyed if self.reads_constitution else without(keyed, {"constitution", "principles"})


