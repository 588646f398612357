"""Run directories as rlaif writes them, for the report's tests (test_report.py, test_report_lineage.py)."""
import json
import random

from rlaif import report
from rlaif.io import storage


def fake_run(root, name="r1", gates=None):
    rng = random.Random(0)
    run = root / name
    (run / "evaluate").mkdir(parents=True)
    (run / "ppo").mkdir()
    judges = {n: {"judge": "embedding", "win_rate": w, "win_rate_ci95": [w - 0.05, w + 0.05],
                  "win_rate_length_controlled": w - 0.02, "wins": 60, "ties": 10, "losses": 30,
                  "position_consistency": 1.0}
              for n, w in (("training", 0.65), ("heldout", 0.58))}
    metrics = {"n_prompts": 100, "win_rate": 0.65, "win_rate_ci95": [0.6, 0.7], "win_rate_length_controlled": 0.63,
               "wins": 60, "ties": 10, "losses": 30, "judges": judges, "reward_policy_mean": 0.8,
               "reward_reference_mean": 0.1, "kl_to_reference": 2.5, "kl_to_reference_per_token": 0.05,
               "length_policy_mean": 30.0, "length_reference_mean": 25.0, "gates": gates or {"checked": False}}
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    examples = [{"id": f"p{i}", "prompt": f"question <{i}>", "tuned": "good & kind", "reference": "meh",
                 "reward_tuned": rng.gauss(1, 1), "reward_reference": rng.gauss(0, 1),
                 "length_tuned": rng.randint(20, 40), "length_reference": rng.randint(10, 40),
                 "p_tuned_better": {"training": 0.7, "heldout": 0.6}}
                for i in range(50)]
    (run / "evaluate" / "examples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in examples))
    (run / "ppo" / "metrics.jsonl").write_text(
        "".join(json.dumps({"iteration": i, "reward_raw": i * 0.1, "kl": i * 0.05}) + "\n" for i in range(1, 11)))
    return run


# A run as this version of rlaif writes it: stage manifests with times and code digests, config.yaml,
# label/metrics.json, PPO diagnostics, and examples crafted so each kind of pick has one clear winner.
CONFIG_YAML = """run_id: full
seed: 7
policy: {model: Qwen/Qwen2.5-0.5B-Instruct}
train_rm: {backbone: /models/deberta-v3-base}
ppo: {algorithm: ppo, reward: reward_model, lr: 2.0e-05, kl_coef: 0.03, iterations: 10}
evaluate: {n_examples: 6}
"""
STAGE_SECONDS = {"generate": 12.0, "label": 30.5, "train_rm": 125.0, "ppo": 3700.0, "evaluate": 40.0}
RM_SUMMARY = {"train_pairs": 900, "held_out_pairs": 100, "reward_mean": 0.1, "reward_std": 1.2,
              "held_out_accuracy": 0.8125, "held_out_accuracy_confident": 0.9375, "held_out_soft_ce": 0.4321,
              "held_out_calibration_mae": 0.1234, "held_out_reference_accuracy": 0.7654, "held_out_reference_pairs": 64,
              "steps": 56, "seconds": 100.0, "samples_per_s": 9.0}
LABEL_METRICS = {"pairs_judged": 1024, "pairs": 1000, "dropped_low_confidence": 24, "mean_p_a": 0.4876,
                 "p_a_histogram": [300, 70, 50, 50, 50, 60, 70, 60, 64, 250], "reference_agreement": 0.9123,
                 "reference_clear_pairs": 700, "reference_graded_pairs": 1024, "judge": "hf:judge-7b",
                 "mode": "pairwise", "principles": "sample", "position_consistency": 0.8765}


def example_row(i, p_training, p_heldout, reward_tuned, reward_reference):
    judges = {"training": p_training, "heldout": p_heldout}
    return {"id": f"p{i}", "prompt": f"prompt number {i}", "tuned": f"tuned answer {i}",
            "reference": f"start answer {i}", "reward_tuned": reward_tuned, "reward_reference": reward_reference,
            "length_tuned": 30, "length_reference": 20, "p_tuned_better": judges}


def crafted_examples():
    ordinary = [example_row(i, 0.6, 0.55, 0.5 + 0.01 * i, 0.4) for i in range(10)]  # small spread, small gains
    return [*ordinary[:3], example_row(10, 0.95, 0.05, 0.3, 0.2),  # the judges' largest disagreement
            *ordinary[3:6], example_row(11, 0.7, 0.65, 3.0, -1.0),  # the largest reward gain (+4)
            example_row(12, 0.6, 0.5, -2.5, 0.5),  # the largest reward loss (-3)
            example_row(13, 0.6, 0.58, 0.0, 1.0),  # the second largest loss (-1)
            *ordinary[6:]]


def stage_key(config_yaml: str, stage: str, inputs: dict) -> str:
    """The cache key a stage run with this config.yaml and these inputs records (as rlaif.stages.common computes it)."""
    from rlaif.config import parse_config, stage_config_hash
    from rlaif.graph import STAGE_BY_NAME
    from rlaif.stages.common import content_keyed_fields

    cfg = parse_config(config_yaml, "test")
    return stage_config_hash(cfg, STAGE_BY_NAME[stage].config_sections, inputs, content_keyed_fields(cfg, stage))


def write_manifests(run, with_times=True, config_yaml=CONFIG_YAML):
    """Manifests as a run's stages write them: each records its inputs' digests and its cache key for config_yaml."""
    from rlaif.graph import STAGE_BY_NAME
    from rlaif.io import manifest

    summaries = {"generate": {"pairs": 1024, "seconds": 9.0}, "label": LABEL_METRICS, "train_rm": RM_SUMMARY,
                 "ppo": {"algorithm": "ppo", "reward": "reward_model", "iterations": 10, "seconds_per_iteration": 2.5},
                 "evaluate": {}}
    digests = {}
    for stage, summary in summaries.items():
        inputs = {"prompts": "sha-of-the-prompts", **{dep: digests[dep] for dep in STAGE_BY_NAME[stage].inputs}}
        written = manifest.write(storage.normalize(str(run / stage)), stage=stage, run_id=run.name,
                                 config_hash=stage_key(config_yaml, stage, inputs), inputs=inputs, num_samples=1,
                                 summary=summary, seconds=STAGE_SECONDS[stage] if with_times else None)
        digests[stage] = written["digest"]
        if not with_times:  # as rlaif wrote manifests before it recorded times and code digests
            old = {k: v for k, v in written.items() if k not in ("seconds", "code_digest")}
            (run / stage / "manifest.json").write_text(json.dumps(old))


def full_run(root, name="full"):
    run = fake_run(root, name)
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["heldout"]["win_rate_ci95"] = [0.47, 0.69]  # this judge cannot tell the policies apart
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    (run / "evaluate" / "examples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in crafted_examples()))
    (run / "config.yaml").write_text(CONFIG_YAML)
    (run / "label").mkdir()
    (run / "label" / "metrics.json").write_text(json.dumps(LABEL_METRICS))
    rows = [{"iteration": i, "reward_raw": 0.1 * i, "kl": 0.2 * i, "entropy": 1.6 - 0.1 * i, "eos_rate": 0.5 + 0.05 * i,
             "clip_frac": 0.01 * i, "value_loss": 1.0 / i, "approx_kl": 0.001 * i, "kl_coef": 0.03}
            for i in range(1, 11)]
    (run / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_manifests(run)
    return run


def md_section(md: str, title: str) -> str:
    """The Markdown between '## title' and the next '## ' heading."""
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def build_report(run):
    storage.configure(None)
    page = storage.local_path(report.write(storage.normalize(str(run)))).read_text()
    return (run / "evaluate" / "report.md").read_text(), page
