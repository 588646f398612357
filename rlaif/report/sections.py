"""The report's blocks as plain tables (title, header, rows of text, a note, the figures that go with it), so
report.md and report.html render the same content: the headline numbers, provenance, labeling, the reward model,
PPO diagnostics and stage times. A field a run's files lack shows as "n/a"."""
from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field

from rlaif.report.run import NA, Run, dig, duration, num, text
from rlaif.report.verdicts import interval, undecided_note


@dataclass
class Block:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""
    images: list[str] = field(default_factory=list)  # plot file names shown with the block

    @property
    def keyed(self) -> bool:
        """A two-column table of names and values (the first column renders as a row heading)."""
        return len(self.header) == 2


def _judge_row(name: str, judge: dict) -> list[str]:
    ci = interval(judge)
    value = num(judge.get("win_rate")) + (f" [95% CI {ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
    value += (f"; length-controlled {num(judge.get('win_rate_length_controlled'))}; "
              f"{text(judge.get('wins'))}/{text(judge.get('ties'))}/{text(judge.get('losses'))} W/T/L")
    note = undecided_note(judge)
    return [f"win rate, judge '{name}'", value + (f" ⚠ this judge {note}" if note else "")]


def _pair(a, b, spec: str = ".3f", sep: str = " vs ") -> str:
    return f"{num(a, spec)}{sep}{num(b, spec)}"


def summary(metrics: dict) -> Block:
    rows = [_judge_row(name, j) for name, j in metrics["judges"].items()]
    m = metrics.get
    rows += [["prompts (held out)", text(m("n_prompts"))],
             ["reward (normalised), tuned vs start", _pair(m("reward_policy_mean"), m("reward_reference_mean"))],
             ["KL to reference (per sequence / per token)",
              f"{num(m('kl_to_reference'))} / {num(m('kl_to_reference_per_token'), '.4f')}"],
             ["response length (tokens), tuned vs start", _pair(m("length_policy_mean"), m("length_reference_mean"),
                                                                ".1f")]]
    if "eos_rate_policy" in metrics:
        rows.append(["answers ending with EOS, tuned vs start", _pair(m("eos_rate_policy"), m("eos_rate_reference"))])
    if "diversity" in metrics:
        tuned, start = m("diversity") or {}, m("diversity_reference") or {}
        rows.append(["most common answer's share / distinct-2, tuned vs start",
                     f"{_pair(tuned.get('top_response_share'), tuned.get('distinct_2'), sep=' / ')} vs "
                     f"{_pair(start.get('top_response_share'), start.get('distinct_2'), sep=' / ')}"])
    upstream = m("upstream") or {}
    if upstream.get("label_reference_agreement") is not None:
        rows.append(["AI labeler's agreement with the reference judge (clear pairs)",
                     num(upstream["label_reference_agreement"])])
    if upstream.get("rm_held_out_accuracy") is not None:
        rows.append(["reward model held-out accuracy: AI labels / reference judge",
                     _pair(upstream["rm_held_out_accuracy"], upstream.get("rm_held_out_reference_accuracy"),
                           sep=" / ")])
    gates = m("gates") or {}
    if gates.get("checked"):
        rows.append(["quality gates", "passed" if gates.get("passed") else
                     "FAILED: " + "; ".join(gates.get("failures", []))])
    return Block("", ["metric", "value"], rows, images=["win_rate.png", "distributions.png"])


def short(digest) -> str:
    return digest[:12] if isinstance(digest, str) and digest else NA


def _across_stages(run: Run, key: str, shorten: bool = False) -> str:
    """One value every stage manifest records (the rlaif version, the code digest), or each stage's where they
    differ."""
    found = {stage: m[key] for stage, m in run.manifests.items() if m and m.get(key)}
    shown = {stage: short(v) if shorten else str(v) for stage, v in found.items()}
    if len(set(shown.values())) > 1:
        return "differs by stage: " + ", ".join(f"{stage} {v}" for stage, v in shown.items())
    return next(iter(shown.values()), NA)


def labeler(run: Run) -> str:
    """The labeling judge as the label output now records it, else as the evaluation did, else as config.yaml names
    it (marked where that differs from what the stages ran with)."""
    label, evaluated = run.label_metrics, dig(run.metrics, "judges", "training", "judge")
    how = ", ".join(f"{k} {label[k]}" for k in ("mode", "principles") if label.get(k))
    if label.get("judge") or evaluated:
        return text(label.get("judge") or evaluated) + (f" ({how})" if how else "")
    return text(dig(run.config, "label", "judge")) + run.lineage.caveat(sections=("label",))


def training_judge(run: Run) -> str:
    """The labeling (training) judge behind the results: the label output's, where it is the one they were made
    from; else the judge the evaluation recorded as its training judge, with the label output now named beside it."""
    if run.lineage.evaluated("label"):
        return labeler(run)
    evaluated = f"{text(dig(run.metrics, 'judges', 'training', 'judge'))} (as the evaluation recorded it)"
    if run.manifests.get("label") is None:
        return f"{evaluated} ⚠ the label output it was trained on is gone"
    return f"{evaluated} ⚠ the label output now, {labeler(run)}, may not be the one the policy was trained on"


def _kl_coef(run: Run) -> str:
    ppo = dig(run.config, "ppo") or {}
    value = num(ppo.get("kl_coef"), "g")
    if ppo.get("adaptive_kl_target") is not None:
        last = next((r["kl_coef"] for r in reversed(run.ppo_rows) if "kl_coef" in r), None)
        value += f" (adaptive, target KL {num(ppo['adaptive_kl_target'], 'g')}; last {num(last, '.4g')})"
    return value + run.lineage.caveat(("ppo",) if ppo.get("adaptive_kl_target") is not None else (), ("ppo",))


def _ppo_settings(run: Run, *keys: str) -> str:
    """PPO settings as its manifest records them, where that output is the evaluated one; else config.yaml's
    (marked where that may not be what the evaluated output ran with)."""
    recorded = run.summary("ppo")
    if all(recorded.get(key) is not None for key in keys) and run.lineage.evaluated("ppo"):
        return " / ".join(text(recorded[key]) for key in keys)
    shown = " / ".join(text(dig(run.config, "ppo", key) or recorded.get(key)) for key in keys)
    return shown + run.lineage.caveat(("ppo",), ("ppo",))


def _from_config(run: Run, *keys: str, spec: str | None = None) -> str:
    """A setting of config.yaml, marked where its section differs from what the evaluated stages ran with."""
    value = dig(run.config, *keys)
    return (num(value, spec) if spec else text(value)) + run.lineage.caveat(sections=keys[:1])


def _compared(unread: str | None) -> str:
    """How config.yaml's settings were checked against the stages', for the provenance note."""
    if unread is None:  # no evaluate manifest: no stages to compare with
        return ""
    if unread:
        return f" (not compared with the stages' cache keys: {unread})"
    return (" (compared with each evaluated stage's cache key, recomputed from them with the inputs its manifest "
            "recorded: a file setting is compared by the content the stage read, not by its path)")


def provenance(run: Run) -> Block:
    """Which models, judges, settings and code made this run (config.yaml and the stage manifests)."""
    judges = "; ".join(f"{name}: {text(j.get('judge'))}" for name, j in run.metrics["judges"].items())
    lineage = run.lineage
    rows = [["policy (as named in the config)", _from_config(run, "policy", "model")],
            ["reward-model backbone", _from_config(run, "train_rm", "backbone")],
            ["labeling (training) judge", training_judge(run)],
            ["evaluation judges", judges or NA],
            ["PPO algorithm / reward", _ppo_settings(run, "algorithm", "reward")],
            ["PPO learning rate", _from_config(run, "ppo", "lr", spec="g")],
            ["KL coefficient", _kl_coef(run)],
            ["PPO iterations", _ppo_settings(run, "iterations")],
            ["seed", _from_config(run, "seed")],
            ["rlaif version", _across_stages(run, "code_version") + lineage.caveat(tuple(run.manifests))],
            ["code digest (rlaif source)",
             _across_stages(run, "code_digest", shorten=True) + lineage.caveat(tuple(run.manifests))],
            ["config digest (sha256 of config.yaml)", short(run.config_digest)
             + (" ⚠ not the config the evaluated stages ran with" if lineage.settings_changed else "")]]
    compared = _compared(lineage.settings_unread)
    return Block("Provenance", ["item", "value"], rows,
                 note=f"Settings from the run's config.yaml as launched last{compared}; the labeling judge and "
                      "PPO's algorithm, reward and iterations as the stage outputs recorded them; versions and digests "
                      "from the stage manifests. ⚠ marks a value that may not be what the results were made with. "
                      "Digests are shown by their first 12 hex digits.")


def _committed(m: dict | None) -> float | None:
    try:
        return calendar.timegm(time.strptime(m["created_at"], "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, KeyError, ValueError):
        return None


def _stage_time(m: dict | None, previous: dict | None, running_seconds: float | None) -> str:
    """The manifest's seconds; for an older manifest, the stage's own timer (generate, train_rm, ppo: its work only)
    or else the time since the previous stage's commit (an upper bound); else n/a."""
    if m is None:
        return f"{duration(running_seconds)} (until this report)" if running_seconds is not None else NA
    if isinstance(m.get("seconds"), (int, float)):
        return duration(m["seconds"])
    s = m.get("summary") or {}
    work = s.get("seconds")
    if work is None and isinstance(s.get("seconds_per_iteration"), (int, float)) and s.get("iterations"):
        work = s["seconds_per_iteration"] * s["iterations"]
    if isinstance(work, (int, float)):
        return f"{duration(work)} (the stage's work only)"
    since = (_committed(m) or 0) - (_committed(previous) or float("inf"))
    return f"at most {duration(since)} (since the previous commit)" if since >= 0 else NA


def stage_times(run: Run, evaluate_seconds: float | None = None) -> Block:
    rows, previous = [], None
    for stage, m in run.manifests.items():
        running = evaluate_seconds if stage == "evaluate" else None
        rows.append([stage, _stage_time(m, previous, running), text(dig(m, "created_at")),
                     text(dig(m, "code_version")), short(dig(m, "code_digest")), short(dig(m, "config_hash"))])
        previous = m
    total = [m.get("seconds") for m in run.manifests.values() if m]
    if total and len(total) == len(run.manifests) and all(isinstance(t, (int, float)) for t in total):
        rows.append(["all stages", duration(sum(total)), "", "", "", ""])
    return Block("Stage times", ["stage", "time", "committed (UTC)", "rlaif version", "code digest", "cache key"],
                 rows, note="Time from the stage process's start to its commit (a resumed stage: its last attempt). A "
                            "manifest written before rlaif recorded times shows the stage's own timer or the time "
                            "since the previous stage's commit where it can; n/a: no manifest.")
