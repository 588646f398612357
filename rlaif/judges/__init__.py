"""AI judges. Every judge has `name` and `prefer_first(prompts, first, second, principles) -> Tensor` (P(first is
better), one order, on the CPU); judges that can score one response alone (d-RLAIF) also have
`direct_score(prompts, responses, principles) -> Tensor` in [-1, 1]."""
from __future__ import annotations

from rlaif.errors import UserError
from rlaif.judges.pairwise import debiased  # noqa: F401 - the judges' shared entry point


def make_judge(settings, batch_size: int, references: dict[str, list[str]] | None = None):
    """The judge that `settings` (label's config or an evaluation JudgeSpec) names. `references` (prompt text -> key
    points) is what the `reference` judge grades against."""
    if settings.judge == "embedding":
        from rlaif.judges.constitution import load_constitution
        from rlaif.judges.embedding import EmbeddingJudge

        contrasts = {p["text"]: p["contrast"] for p in load_constitution(settings.constitution) if p.get("contrast")}
        return EmbeddingJudge(settings.temperature, settings.relevance_weight, batch_size, contrasts=contrasts)
    if settings.judge == "reference":
        from rlaif.judges.reference import ReferenceJudge

        return ReferenceJudge(settings.reference, settings.temperature, references)
    if settings.judge == "hf":
        from rlaif.judges.hf import HFJudge

        return HFJudge(settings, batch_size)
    if settings.judge == "openai":
        from rlaif.judges.openai import OpenAIJudge

        return OpenAIJudge(settings)
    if settings.judge == "rules":
        from rlaif.judges.rules import RulesJudge

        return RulesJudge(settings.rules, settings.temperature)
    raise UserError(f"unknown judge {settings.judge!r}: use embedding, hf, openai, rules or reference")


def judge_scorer(cfg):
    """PPO with ppo.reward=judge (d-RLAIF): label's judge scores each response alone in [-1, 1], against a
    principle sampled per prompt."""
    from rlaif.io.prompts import load_prompts
    from rlaif.judges.constitution import judge_principles, score_each
    from rlaif.judges.reference import reference_points

    judge = make_judge(cfg.label, cfg.label.batch_size, reference_points(load_prompts(cfg.data)))
    if not hasattr(judge, "direct_score"):
        raise UserError(f"ppo.reward=judge needs a judge that scores one response alone (hf, rules or reference), not "
                        f"{judge.name}")
    principles = judge_principles(cfg.label)

    def score(prompts: list[str], responses: list[str]):  # -> a tensor of scores in [-1, 1]
        return score_each(judge, principles, cfg.label.principles, cfg.seed, prompts, prompts, responses)

    return score


def check_services(cfg, stage: str) -> None:
    """Before label, or evaluate (which asks label's judge too), runs: no judge behind an HTTP endpoint is down,
    refuses our key or speaks something other than JSON (ServiceClient.check_answers), and an endpoint judge's
    service takes its request for its model (OpenAIJudge.check_serves_model, which asks both). Else label would find
    out only after generate had run."""
    from rlaif.serving.client import ServiceClient

    further = [(judge.setting, judge) for judge in cfg.evaluate.judges] if stage == "evaluate" else []
    for where, judge in [("label", cfg.label), *further]:
        if judge.judge == "openai":
            from rlaif.judges.openai import OpenAIJudge

            OpenAIJudge(judge).check_serves_model()
        elif judge.pod_judge == "served":  # which model it serves: checked when label starts
            ServiceClient(judge.hf.endpoint, f"{where}.hf.endpoint").check_answers()
