"""The blocks on what came before the evaluation: the labels (label/metrics.json), the reward model (train_rm's
manifest summary) and PPO's training diagnostics (ppo/metrics.jsonl). A field an older run lacks shows as "n/a"."""
from __future__ import annotations

from rlaif.report.run import NA, Run, dig, num
from rlaif.report.sections import Block, labeler

# (metrics.jsonl key, label); the first block always shows (n/a where not logged), the rest where logged
PPO_ALWAYS = [("entropy", "policy entropy (per token)"), ("eos_rate", "answers ending with EOS"),
              ("clip_frac", "clipped ratio fraction"), ("value_loss", "value loss"),
              ("approx_kl", "approx. KL to the rollout policy")]
PPO_LOGGED = [("reward_raw", "reward-model score"), ("kl", "KL to reference (per sequence)"),
              ("kl_coef", "KL coefficient"), ("kl_loss", "KL loss (GRPO)"),
              ("explained_variance", "value explained variance"), ("grad_norm", "gradient norm"),
              ("response_length", "response length (tokens)"), ("ppo_epochs_run", "PPO epochs run")]


def _count(value) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else NA


def _caveat(run: Run, stage: str) -> str:
    """A block's first words where it reads an output of `stage` other than the one the results were made from."""
    if run.lineage.evaluated(stage):
        return ""
    return f"⚠ The {stage} output now may not be the one these results were made from (the notes at the top say why). "


def _reference_agreement(run: Run) -> str:
    label = run.label_metrics
    agreement = label.get("reference_agreement", dig(run.metrics, "upstream", "label_reference_agreement"))
    if agreement is None:
        return NA if label.get("reference_graded_pairs") is None else "n/a (no clear reference preferences)"
    if label.get("reference_clear_pairs") is None:
        return num(agreement)
    return (f"{num(agreement)} on {_count(label['reference_clear_pairs'])} clear pairs "
            f"(of {_count(label.get('reference_graded_pairs'))} graded)")


def labeling(run: Run) -> Block:
    label = run.label_metrics
    histogram = label.get("p_a_histogram")
    rows = [["judge", labeler(run)],
            ["pairs judged / kept / dropped as low-confidence",
             f"{_count(label.get('pairs_judged'))} / {_count(label.get('pairs'))} / "
             f"{_count(label.get('dropped_low_confidence'))}"],
            ["position consistency (both orders prefer the same answer)", num(label.get("position_consistency"))],
            ["agreement with the reference judge", _reference_agreement(run)],
            ["mean p(a)", num(label.get("mean_p_a"))],
            ["p(a) histogram (10 bins from 0 to 1)",
             " · ".join(map(str, histogram)) if isinstance(histogram, list) and histogram else NA]]
    if isinstance(label.get("endpoint"), dict):
        rows.append(["judge endpoint", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in label["endpoint"].items())])
    return Block("Labeling", ["statistic", "value"], rows,
                 note=_caveat(run, "label") + "From label/metrics.json. Agreement with the reference judge counts the "
                      "pairs where the reference judge (key-point coverage, no model) has a clear preference.")


def reward_model(run: Run) -> Block:
    rm, upstream = run.summary("train_rm"), run.metrics.get("upstream") or {}
    against = rm.get("held_out_reference_accuracy", upstream.get("rm_held_out_reference_accuracy"))
    if against is not None and rm.get("held_out_reference_pairs") is not None:
        against = f"{num(against)} on {_count(rm['held_out_reference_pairs'])} clear pairs"
    pairs = f"{_count(rm.get('held_out_pairs'))} ({_count(rm.get('train_pairs'))})"
    steps = f"{_count(rm.get('steps'))} / {num(rm.get('samples_per_s'), '.1f')}"
    rows = [["held-out pairs (training pairs)", pairs],
            ["accuracy against the AI labels", num(rm.get("held_out_accuracy", upstream.get("rm_held_out_accuracy")))],
            ["accuracy on confident pairs (|p - 0.5| >= 0.25)", num(rm.get("held_out_accuracy_confident"))],
            ["accuracy against the reference judge", against if isinstance(against, str) else num(against)],
            ["soft cross-entropy (ln 2 = 0.693 is chance)", num(rm.get("held_out_soft_ce"))],
            ["calibration MAE, mean |sigmoid(r_a - r_b) - p|", num(rm.get("held_out_calibration_mae"))],
            ["reward on training answers: mean / std", f"{num(rm.get('reward_mean'))} / {num(rm.get('reward_std'))}"],
            ["optimizer steps / pairs per second", steps]]
    student = rm.get("student") or {}
    if student:
        size = num((student.get("parameters") or 0) / 1e6, ".1f")
        rows += [[f"student ({student.get('layers')} layers, {size}M parameters): agreement with the teacher on "
                  "held-out pairs", num(student.get("pairwise_agreement"))],
                 ["student: Pearson / Spearman with the teacher's scores",
                  f"{num(student.get('pearson'))} / {num(student.get('spearman'))}"],
                 ["student: accuracy against the AI labels", num(student.get("held_out_accuracy"))]]
    return Block("Reward model", ["held-out quality", "value"], rows,
                 note=_caveat(run, "train_rm") + "From train_rm's manifest, on labelled pairs held out of training by "
                      "a key-hash split"
                      + ("; the student's agreement on prompts held out of its distillation." if student else "."))


def _first_last(rows: list[dict], key: str) -> tuple:
    logged = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return (logged[0], logged[-1]) if logged else (None, None)


def ppo_diagnostics(run: Run) -> Block:
    rows_logged = run.ppo_rows
    chosen = PPO_ALWAYS + [(k, label) for k, label in PPO_LOGGED if any(k in r for r in rows_logged)]
    rows = []
    for key, label in chosen:
        first, last = _first_last(rows_logged, key)
        rows.append([label, num(first, ".4g"), num(last, ".4g")])
    ppo = run.summary("ppo")
    per_iteration = ppo.get("seconds_per_iteration")
    note = _caveat(run, "ppo") + (f"From ppo/metrics.jsonl: {len(rows_logged)} iterations logged" if rows_logged
                                  else "No ppo/metrics.jsonl in this run")
    note += f", {per_iteration:.2f} s per iteration." if isinstance(per_iteration, (int, float)) else "."
    algorithm = str(ppo.get("algorithm") or dig(run.config, "ppo", "algorithm") or "ppo")
    return Block(f"{algorithm.upper()} training",
                 ["metric", "first iteration", "last iteration"], rows, note=note,
                 images=["ppo_reward_kl.png", "ppo_diagnostics.png"])
