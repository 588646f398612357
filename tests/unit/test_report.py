import json
import random

from rlaif import report
from rlaif.io import manifest, storage


def _fake_run(root, name="r1", gates=None):
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


def test_report_embeds_plots_judges_and_escaped_examples(tmp_path):
    storage.configure(None)
    run = _fake_run(tmp_path)
    url = report.write(storage.normalize(str(run)))
    page = storage.local_path(url).read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "judge &#x27;heldout&#x27;" in page or "judge 'heldout'" in page
    assert "question &lt;" in page and "good &amp; kind" in page and "question <" not in page  # user text escaped
    assert sorted(p.name for p in (run / "evaluate" / "plots").iterdir()) == ["distributions.png", "ppo_reward_kl.png",
                                                                              "win_rate.png"]
    md = (run / "evaluate" / "report.md").read_text()
    assert "length-controlled 0.630" in md and "| prompts (held out) | 100 |" in md


def test_failed_gate_is_shown(tmp_path):
    storage.configure(None)
    run = _fake_run(tmp_path, gates={"checked": True, "passed": False,
                                     "failures": ["win rate 0.650 < evaluate.min_win_rate 0.9"]})
    page = storage.local_path(report.write(storage.normalize(str(run)))).read_text()
    assert 'class="fail"' in page and "min_win_rate 0.9" in page


def test_compare_runs_side_by_side(tmp_path):
    storage.configure(None)
    a = _fake_run(tmp_path, "alpha")
    b = _fake_run(tmp_path, "beta", gates={"checked": True, "passed": False, "failures": ["win rate 0.650 < 0.9"]})
    metrics = (a / "evaluate/metrics.json").read_bytes()
    (a / "evaluate/manifest.json").write_text(json.dumps({
        "schema_version": manifest.SCHEMA_VERSION, "stage": "evaluate", "config_hash": "h", "inputs": {}, "shards": [],
        "num_samples": 0, "summary": {}, "digest": "d",
        "files": [{"path": "metrics.json", "bytes": len(metrics), "sha256": storage.sha256_file(
            a / "evaluate/metrics.json")}]}))
    md, page = report.compare([storage.normalize(str(a)), storage.normalize(str(b))])
    lines = md.splitlines()
    assert lines[0] == "| metric | alpha | beta |"
    # a run whose evaluation was not committed (its gate failed here) showed its numbers like a finished run's
    assert lines[2] == ("| evaluation | committed | not committed (no evaluate manifest: unfinished, earlier or "
                        "gate-failed; unverified) |")
    assert lines[3] == "| quality gates | not set | FAILED: win rate 0.650 < 0.9 |"
    assert any(line.startswith("| win_rate | 0.650 | 0.650 |") for line in lines)
    assert any("judge 'heldout'" in line for line in lines) and "<table>" in page


def _judge(rate, lo, hi):
    return {"win_rate": rate, "win_rate_ci95": [lo, hi]}


def test_verdicts_say_what_the_numbers_mean():
    from rlaif.report import verdicts

    diversity = {"top_response_share": 0.02, "top_response": "x", "distinct_2": 0.3}
    base = {"n_prompts": 256, "diversity": diversity, "diversity_reference": diversity}
    hacked = verdicts({**base, "judges": {"training": _judge(0.8, 0.75, 0.85), "reference": _judge(0.52, 0.46, 0.58)}})
    assert hacked[0].startswith("Reward hacking") and "cannot tell the two policies apart" in hacked[1]
    real = verdicts({**base, "judges": {"training": _judge(0.8, 0.75, 0.85), "reference": _judge(0.78, 0.72, 0.83)}})
    assert real == [real[0]] and real[0].startswith("The improvement is real")
    taste = verdicts({**base, "judges": {"training": _judge(0.97, 0.95, 0.99), "reference": _judge(0.78, 0.72, 0.83)}})
    assert taste[0].startswith("Part of the gain") and taste[1].startswith("The improvement is real")
    collapsed = {**diversity, "top_response_share": 0.4, "top_response": "Stop asking me things."}
    lines = verdicts({**base, "diversity": collapsed, "judges": {"training": _judge(0.7, 0.64, 0.75)}})
    assert lines == [lines[0]] and lines[0].startswith("Mode collapse: 40%") and "Stop asking" in lines[0]
    one_repeat = {**collapsed, "top_response_share": 1 / 16}  # 16 prompts, each answer once: no collapse to report
    assert verdicts({**base, "n_prompts": 16, "diversity": one_repeat, "judges": {}}) == []
    # A reference judge that tied every comparison graded nothing (key points in another language than the
    # responses): no hacking or taste verdict is drawn from its 0.5, and it is named as such.
    blind = {**_judge(0.5, 0.44, 0.56), "wins": 0, "ties": 256, "losses": 0}
    lines = verdicts({**base, "judges": {"training": _judge(0.66, 0.6, 0.72), "reference": blind}})
    assert lines == ["Judge 'reference' tied all 256 comparisons: it told no two responses apart, so its rate says "
                     "nothing about the tuned policy (the two policies answered alike, or, for the reference judge, "
                     "the key points share no words with the responses)."]


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


def _example(i, p_training, p_heldout, reward_tuned, reward_reference):
    judges = {"training": p_training, "heldout": p_heldout}
    return {"id": f"p{i}", "prompt": f"prompt number {i}", "tuned": f"tuned answer {i}",
            "reference": f"start answer {i}", "reward_tuned": reward_tuned, "reward_reference": reward_reference,
            "length_tuned": 30, "length_reference": 20, "p_tuned_better": judges}


def _crafted_examples():
    ordinary = [_example(i, 0.6, 0.55, 0.5 + 0.01 * i, 0.4) for i in range(10)]  # small spread, small gains
    return [*ordinary[:3], _example(10, 0.95, 0.05, 0.3, 0.2),  # the judges' largest disagreement
            *ordinary[3:6], _example(11, 0.7, 0.65, 3.0, -1.0),  # the largest reward gain (+4)
            _example(12, 0.6, 0.5, -2.5, 0.5),  # the largest reward loss (-3)
            _example(13, 0.6, 0.58, 0.0, 1.0),  # the second largest loss (-1)
            *ordinary[6:]]


def _stage_key(config_yaml: str, stage: str, inputs: dict) -> str:
    """The cache key a stage run with this config.yaml and these inputs records (as rlaif.stages.common computes it)."""
    from rlaif.config import parse_config, stage_config_hash
    from rlaif.graph import STAGE_BY_NAME
    from rlaif.stages.common import content_keyed_fields

    cfg = parse_config(config_yaml, "test")
    return stage_config_hash(cfg, STAGE_BY_NAME[stage].config_sections, inputs, content_keyed_fields(cfg, stage))


def _write_manifests(run, with_times=True, config_yaml=CONFIG_YAML):
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
                                 config_hash=_stage_key(config_yaml, stage, inputs), inputs=inputs, num_samples=1,
                                 summary=summary, seconds=STAGE_SECONDS[stage] if with_times else None)
        digests[stage] = written["digest"]
        if not with_times:  # as rlaif wrote manifests before it recorded times and code digests
            old = {k: v for k, v in written.items() if k not in ("seconds", "code_digest")}
            (run / stage / "manifest.json").write_text(json.dumps(old))


def _full_run(root, name="full"):
    run = _fake_run(root, name)
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["heldout"]["win_rate_ci95"] = [0.47, 0.69]  # this judge cannot tell the policies apart
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    (run / "evaluate" / "examples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in _crafted_examples()))
    (run / "config.yaml").write_text(CONFIG_YAML)
    (run / "label").mkdir()
    (run / "label" / "metrics.json").write_text(json.dumps(LABEL_METRICS))
    rows = [{"iteration": i, "reward_raw": 0.1 * i, "kl": 0.2 * i, "entropy": 1.6 - 0.1 * i, "eos_rate": 0.5 + 0.05 * i,
             "clip_frac": 0.01 * i, "value_loss": 1.0 / i, "approx_kl": 0.001 * i, "kl_coef": 0.03}
            for i in range(1, 11)]
    (run / "ppo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_manifests(run)
    return run


def _section(md: str, title: str) -> str:
    """The Markdown between '## title' and the next '## ' heading."""
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _build(run):
    storage.configure(None)
    page = storage.local_path(report.write(storage.normalize(str(run)))).read_text()
    return (run / "evaluate" / "report.md").read_text(), page


def test_provenance_names_models_settings_code_and_stage_times(tmp_path):
    import hashlib

    from rlaif import __version__
    from rlaif.io.digest import code_digest

    run = _full_run(tmp_path)
    md, page = _build(run)
    block = _section(md, "Provenance")
    config_digest = hashlib.sha256(CONFIG_YAML.encode()).hexdigest()[:12]
    for line in ("| policy (as named in the config) | Qwen/Qwen2.5-0.5B-Instruct |",
                 "| reward-model backbone | /models/deberta-v3-base |",
                 "| labeling (training) judge | hf:judge-7b (mode pairwise, principles sample) |",
                 "| evaluation judges | training: embedding; heldout: embedding |",
                 "| PPO algorithm / reward | ppo / reward_model |", "| PPO learning rate | 2e-05 |",
                 "| KL coefficient | 0.03 |", "| PPO iterations | 10 |", "| seed | 7 |",
                 f"| rlaif version | {__version__} |", f"| code digest (rlaif source) | {code_digest()[:12]} |",
                 f"| config digest (sha256 of config.yaml) | {config_digest} |"):
        assert line in block, line
    times = _section(md, "Stage times")
    assert "| generate | 12.0 s |" in times and "| label | 30.5 s |" in times
    assert "| train_rm | 2 min 05 s |" in times and "| ppo | 1 h 01 min |" in times
    train_rm_key = json.loads((run / "train_rm" / "manifest.json").read_text())["config_hash"]
    assert "| all stages | 1 h 05 min |" in times and f"| {train_rm_key[:12]} |" in times
    assert "<h2>Provenance</h2>" in page and "Qwen/Qwen2.5-0.5B-Instruct" in page and "<h2>Stage times</h2>" in page

    # The evaluate stage writes its report before its manifest, and passes its time so far.
    (run / "evaluate" / "manifest.json").unlink()
    report.write(storage.normalize(str(run)), evaluate_seconds=12.5)
    assert "| evaluate | 12.5 s (until this report) |" in (run / "evaluate" / "report.md").read_text()


def test_reward_model_and_labeling_blocks(tmp_path):
    md, page = _build(_full_run(tmp_path))
    rm = _section(md, "Reward model")
    for line in ("| held-out pairs (training pairs) | 100 (900) |", "| accuracy against the AI labels | 0.812 |",
                 "| accuracy on confident pairs (\\|p - 0.5\\| >= 0.25) | 0.938 |",
                 "| accuracy against the reference judge | 0.765 on 64 clear pairs |",
                 "| soft cross-entropy (ln 2 = 0.693 is chance) | 0.432 |",
                 "| calibration MAE, mean \\|sigmoid(r_a - r_b) - p\\| | 0.123 |"):
        assert line in rm, line
    label = _section(md, "Labeling")
    for line in ("| pairs judged / kept / dropped as low-confidence | 1024 / 1000 / 24 |",
                 "| position consistency (both orders prefer the same answer) | 0.876 |",
                 "| agreement with the reference judge | 0.912 on 700 clear pairs (of 1024 graded) |",
                 "| mean p(a) | 0.488 |", "| p(a) histogram (10 bins from 0 to 1) | 300 · 70 · 50 · 50"):
        assert line in label, line
    assert "<h2>Reward model</h2>" in page and "0.765 on 64 clear pairs" in page and "0.912 on 700 clear pairs" in page


def test_ppo_diagnostics_plot_and_last_values(tmp_path):
    run = _full_run(tmp_path)
    md, page = _build(run)
    block = _section(md, "PPO training")
    for line in ("| policy entropy (per token) | 1.5 | 0.6 |", "| answers ending with EOS | 0.55 | 1 |",
                 "| clipped ratio fraction | 0.01 | 0.1 |", "| value loss | 1 | 0.1 |",
                 "| approx. KL to the rollout policy | 0.001 | 0.01 |", "| reward-model score | 0.1 | 1 |"):
        assert line in block, line
    assert "2.50 s per iteration" in block and "![ppo_diagnostics.png](plots/ppo_diagnostics.png)" in block
    assert (run / "evaluate" / "plots" / "ppo_diagnostics.png").read_bytes().startswith(b"\x89PNG")
    assert page.count("data:image/png;base64,") == 4 and 'alt="ppo_diagnostics.png"' in page


def test_examples_are_chosen_to_teach(tmp_path):
    from rlaif.report.examples import choose

    picks, notes = choose(_crafted_examples(), 3)
    assert [p.example["id"] for p in picks] == ["p10", "p11", "p12"] and notes == []
    assert picks[0].why == "judges disagree: P(tuned better) 'training' 0.95, 'heldout' 0.05"
    assert picks[1].why == "biggest reward gain: +4.000" and picks[2].why == "biggest reward loss: -3.000"

    md, page = _build(_full_run(tmp_path))  # evaluate.n_examples: 6 in the run's config
    examples = _section(md, "Examples")
    headings = [line for line in examples.splitlines() if line.startswith("### ")]
    assert len(headings) == 6
    assert headings[0].startswith("### 1. judges disagree") and headings[2].startswith("### 3. biggest reward gain")
    assert headings[4] == "### 5. biggest reward loss: -3.000" and headings[5] == "### 6. biggest reward loss: -1.000"
    assert examples.split("### 1.", 1)[1].split("### 2.", 1)[0].count("prompt number 10") == 1
    assert examples.split("### 3.", 1)[1].split("### 4.", 1)[0].count("prompt number 11") == 1
    assert examples.split("### 5.", 1)[1].split("### 6.", 1)[0].count("prompt number 12") == 1
    assert '<td class="why">biggest reward loss: -3.000</td><td>prompt number 12</td>' in page


def test_one_judge_and_no_losses_are_noted():
    from rlaif.report.examples import choose

    rows = [{"id": str(i), "reward_tuned": 1.0 + i, "reward_reference": 0.0, "p_tuned_better": {"training": 0.7}}
            for i in range(5)]
    picks, notes = choose(rows, 2)
    assert [p.example["id"] for p in picks] == ["4", "3"]
    assert notes == ["One judge only: no disagreements between judges to show.",
                     "No tuned answer scored lower than the starting answer."]


def test_judge_whose_interval_contains_half_is_noted_by_its_row(tmp_path):
    md, page = _build(_full_run(tmp_path))
    row = next(line for line in md.splitlines() if line.startswith("| win rate, judge 'heldout'"))
    assert "⚠ this judge cannot tell the two policies apart: its interval [0.470, 0.690] contains 0.5" in row
    training = next(line for line in md.splitlines() if line.startswith("| win rate, judge 'training'"))
    assert "contains 0.5" not in training
    assert "> Judge 'heldout' cannot tell the two policies apart" in md  # and among the verdicts at the top
    assert "<th>win rate, judge &#x27;heldout&#x27;</th><td>0.580 [95% CI 0.470, 0.690]" in page


def test_old_run_without_the_new_fields_shows_na(tmp_path, capsys):
    """A run from before these blocks: manifests without times or code digests, no config.yaml or
    label/metrics.json, metrics.json without the newer fields, examples without rewards and with one judge."""
    from rlaif import cli

    run = _fake_run(tmp_path, "old")
    (run / "label").mkdir()
    _write_manifests(run, with_times=False)
    (run / "train_rm" / "manifest.json").unlink()
    judges = {"training": {"judge": "embedding", "win_rate": 0.6, "win_rate_ci95": [0.55, 0.65]}}
    (run / "evaluate" / "metrics.json").write_text(json.dumps({"n_prompts": 10, "judges": judges}))
    (run / "evaluate" / "examples.jsonl").write_text("".join(
        json.dumps({"prompt": f"q{i}", "tuned": "a", "reference": "b", "p_tuned_better": {"training": 0.6}}) + "\n"
        for i in range(12)))
    assert cli.main(["report", str(run)]) == 0
    assert "report.html" in capsys.readouterr().out
    md = (run / "evaluate" / "report.md").read_text()
    assert "| policy (as named in the config) | n/a |" in md
    # train_rm's output is gone: the outputs above it cannot be matched with the ones the results were made from
    assert "> These results were made from an earlier train_rm output of this run, since removed" in md
    assert "whether the generate and label outputs above it are the ones behind them cannot be told" in md
    assert "| code digest (rlaif source) | n/a ⚠ may not be the evaluated generate, label and train_rm outputs' |" in md
    assert "| config digest (sha256 of config.yaml) | n/a |" in md and "| rlaif version | 0.1.0 ⚠" in md
    assert "| accuracy against the AI labels | n/a |" in md and "| held-out pairs (training pairs) | n/a (n/a) |" in md
    assert "| reward (normalised), tuned vs start | n/a vs n/a |" in md
    assert "| policy entropy (per token) | n/a | n/a |" in md  # ppo rows logged reward and KL only
    assert ("| labeling (training) judge | embedding (as the evaluation recorded it) ⚠ the label output now, "
            "hf:judge-7b (mode pairwise, principles sample), may not be the one the policy was trained on |") in md
    times = _section(md, "Stage times")
    assert "| generate | 9.0 s (the stage's work only) |" in times
    assert "| ppo | 25.0 s (the stage's work only) |" in times
    assert "| train_rm | n/a |" in times and "| label | at most 0.0 s (since the previous commit) |" in times
    examples = _section(md, "Examples")
    assert examples.count("### ") == 8 and "nothing to choose by" in examples and "One judge only" in examples
    assert sorted(p.name for p in (run / "evaluate" / "plots").iterdir()) == ["ppo_reward_kl.png", "win_rate.png"]


def test_a_rebuilt_report_says_where_its_results_are_out_of_date(tmp_path):
    # after a re-run that changed ppo and was interrupted: evaluate's results are of the old ppo output
    from rlaif.io import manifest

    run = _full_run(tmp_path)
    url = storage.normalize(str(run / "evaluate"))
    recorded = json.loads((run / "ppo" / "manifest.json").read_text())["digest"]
    manifest.write(url, stage="evaluate", run_id=run.name, config_hash="evaluate-key", num_samples=1, summary={},
                   inputs={"ppo": recorded, "train_rm": "digest-of-another-train_rm", "prompts.jsonl": "a-file"})
    md, _ = _build(run)
    assert "earlier train_rm output of this run, since made again" in md and "earlier ppo output" not in md
    (run / "ppo" / "manifest.json").unlink()  # ppo re-running, interrupted
    md, _ = _build(run)
    assert "earlier ppo output of this run, since removed" in md
    (run / "evaluate" / "manifest.json").unlink()
    md, _ = _build(run)
    assert "evaluate has no manifest" in md
    stage_built = storage.local_path(report.write(storage.normalize(str(run)), evaluate_seconds=3.0))
    assert "evaluate has no manifest" not in stage_built.read_text()  # the stage writes it before its manifest


def test_results_changed_since_evaluate_committed_them_are_refused(tmp_path):
    """A hand-edited or foreign metrics.json would be published as the run's own result: checked against the sha256
    evaluate's manifest recorded, by the report and by comparisons (not while the stage builds it, before then)."""
    import pytest

    from rlaif.errors import UserError
    from rlaif.io import manifest

    storage.configure(None)
    run, other = _fake_run(tmp_path), _fake_run(tmp_path, "r2")
    evaluate = run / "evaluate"
    files = [{"path": name, "bytes": (evaluate / name).stat().st_size, "sha256": storage.sha256_file(evaluate / name)}
             for name in ("metrics.json", "examples.jsonl")]
    manifest.write(storage.normalize(str(evaluate)), stage="evaluate", run_id=run.name, config_hash="k",
                   num_samples=1, summary={}, inputs={}, files=files)
    url, other_url = storage.normalize(str(run)), storage.normalize(str(other))
    report.write(url)
    metrics = json.loads((evaluate / "metrics.json").read_text())
    metrics["win_rate"] = 0.99
    (evaluate / "metrics.json").write_text(json.dumps(metrics))
    for build in (lambda: report.write(url), lambda: report.compare([url, other_url])):
        with pytest.raises(UserError, match="metrics.json does not match its manifest checksum"):
            build()
    report.write(url, evaluate_seconds=1.0)  # the stage builds its report before its manifest


def test_numbers_that_do_not_hold_together_are_drawn_or_shown_as_missing(tmp_path):
    """Without a manifest to check them against: a rate outside its interval draws no error bar instead of failing,
    a rate that is not a number is shown as missing, and runs of one directory name are told apart."""
    storage.configure(None)
    run = _fake_run(tmp_path / "a")
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["training"]["win_rate_ci95"] = [0.8, 0.9]  # the rate 0.65 outside it
    metrics["win_rate"], metrics["kl_to_reference"] = "high", None
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    report.write(storage.normalize(str(run)))
    md, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(_fake_run(tmp_path / "b")))])
    assert md.splitlines()[0] == "| metric | a/r1 | b/r1 |"
    assert any(line.startswith("| win_rate | - | 0.650 |") for line in md.splitlines())


def _relaunch(run, stage, summary, config_yaml=CONFIG_YAML):
    """`rlaif launch <stage>` on a finished run: a new output of `stage` (made from the outputs above it now, keyed
    by config_yaml), which nothing below it has read."""
    from rlaif.graph import STAGE_BY_NAME

    inputs = {"prompts": "sha-of-the-prompts", **{dep: json.loads((run / dep / "manifest.json").read_text())["digest"]
                                                  for dep in STAGE_BY_NAME[stage].inputs}}
    manifest.write(storage.normalize(str(run / stage)), stage=stage, run_id=run.name, num_samples=2,
                   config_hash=_stage_key(config_yaml, stage, inputs), inputs=inputs, summary=summary)


def test_a_relabelled_run_does_not_show_the_new_judge_as_the_one_behind_its_results(tmp_path):
    """`rlaif launch label` with another judge on a finished run: the win rates are still those of the policy trained
    on the old labels. The report said nothing and showed the new judge and its statistics as the run's."""
    run = _full_run(tmp_path)
    relabelled = CONFIG_YAML + "label: {judge: reference}\n"
    (run / "config.yaml").write_text(relabelled)
    new_labels = {**LABEL_METRICS, "judge": "reference", "reference_agreement": 1.0}
    (run / "label" / "metrics.json").write_text(json.dumps(new_labels))
    _relaunch(run, "label", new_labels, relabelled)
    md, page = _build(run)
    assert ("> These results were made from an earlier label output of this run, since made again: what this report "
            "shows of it (statistics, curves, settings) may not be what they were made from; whether the generate "
            "output above it is the one behind them cannot be told.") in md
    assert "> config.yaml no longer holds the settings ppo, evaluate ran with" in md  # label is keyed by both
    assert ("| labeling (training) judge | embedding (as the evaluation recorded it) ⚠ the label output now, "
            "reference (mode pairwise, principles sample), may not be the one the policy was trained on |") in md
    assert _section(md, "Labeling").split("\n_")[-1].startswith("⚠ The label output now may not be the one")
    assert "| KL coefficient | 0.03 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| seed | 7 |" in md and "| reward-model backbone | /models/deberta-v3-base |" in md  # train_rm matches
    assert "earlier label output of this run, since made again" in page


def test_a_hand_edited_config_is_not_shown_as_the_settings_of_the_results(tmp_path):
    run = _full_run(tmp_path)
    md, _ = _build(run)
    assert "⚠" not in _section(md, "Provenance").split("\n_")[0] and "config.yaml no longer" not in md  # as run
    (run / "config.yaml").write_text(CONFIG_YAML.replace("lr: 2.0e-05, kl_coef: 0.03", "lr: 0.5, kl_coef: 0.9"))
    md, _ = _build(run)
    assert "> config.yaml no longer holds the settings ppo ran with (edited by hand, or a stage launched" in md
    assert "| PPO learning rate | 0.5 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| KL coefficient | 0.9 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| PPO iterations | 10 |" in md  # as ppo's manifest recorded it
    assert "| seed | 7 |" in md and "| policy (as named in the config) | Qwen/Qwen2.5-0.5B-Instruct |" in md
    assert "⚠ not the config the evaluated stages ran with |" in md and "earlier" not in md


def test_an_upstream_output_made_again_or_removed_is_flagged_through_the_stage_graph(tmp_path):
    """The stale check looked at evaluate's own inputs only: a generate made again under label, or a label output
    removed, went unnoticed (only a removed ppo output was flagged)."""
    run = _full_run(tmp_path)
    _relaunch(run, "generate", {"pairs": 2048})
    md, _ = _build(run)
    assert "> These results were made from an earlier generate output of this run, since made again" in md
    assert "earlier label output" not in md and "| labeling (training) judge | hf:judge-7b" in md
    (run / "label" / "manifest.json").unlink()  # a label re-run that did not finish
    md, _ = _build(run)
    assert "> These results were made from an earlier label output of this run, since removed" in md
    assert ("| labeling (training) judge | embedding (as the evaluation recorded it) ⚠ the label output it was "
            "trained on is gone |") in md
    (run / "label" / "manifest.json").write_text('{"schema_version": 1, "sta')  # cut short
    md, _ = _build(run)
    assert "earlier label output of this run, since unreadable (its manifest is damaged (not valid JSON" in md
    assert "⚠" not in _section(md, "Reward model") and "⚠" not in _section(md, "PPO training")


def test_a_comparison_shows_settings_stale_notes_and_judges_that_differ(tmp_path):
    storage.configure(None)
    runs = [_full_run(tmp_path, name) for name in ("a", "b", "c")]
    metrics = json.loads((runs[1] / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["training"]["judge"] = "hf:judge-7b"  # b's policy was trained against another judge
    (runs[1] / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    (runs[2] / "ppo" / "manifest.json").unlink()  # c's ppo re-run did not finish
    md, page = report.compare([storage.normalize(str(run)) for run in runs])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["evaluation"] == "| evaluation | committed | committed | committed ⚠ out of date: see the notes below |"
    assert rows["win rate, judge 'training' ⚠ a different judge per run: not comparable"] == (
        "| win rate, judge 'training' ⚠ a different judge per run: not comparable | 0.650 (embedding) | "
        "0.650 (hf:judge-7b) | 0.650 (embedding) |")
    assert "win_rate ⚠ the training judges differ: not comparable" in rows
    assert rows["win rate, judge 'heldout'"].endswith("| 0.580 | 0.580 | 0.580 |")  # the same judge in every run
    label = "hf:judge-7b (mode pairwise, principles sample)"
    assert rows["labeling (training) judge"] == f"| labeling (training) judge | {label} | {label} | {label} |"
    assert rows["policy (as named in the config)"].count("Qwen/Qwen2.5-0.5B-Instruct") == 3
    assert rows["PPO algorithm / reward"] == ("| PPO algorithm / reward | ppo / reward_model | ppo / reward_model | "
                                              "ppo / reward_model ⚠ may not be the evaluated ppo output's |")
    assert rows["config digest (sha256 of config.yaml)"].count(report_digest := _config_digest()) == 3, report_digest
    assert md.split("## Notes\n\n", 1)[1].startswith(
        "- **c**: These results were made from an earlier ppo output of this run, since removed")
    assert "<h2>Notes</h2><ul><li><b>c</b>: These results were made from an earlier ppo output" in page


def _config_digest() -> str:
    import hashlib

    return hashlib.sha256(CONFIG_YAML.encode()).hexdigest()[:12]


def test_metrics_of_another_shape_show_as_na_and_are_named(tmp_path, capsys):
    """Without an evaluate manifest nothing checks metrics.json's shape: fields of another shape gave IndexError
    and AttributeError tracebacks (exit 1) in the plots, the headline table and the judge rows."""
    from rlaif import cli

    run = _fake_run(tmp_path)
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["training"]["win_rate_ci95"] = [0.2]
    metrics["judges"]["heldout"] = [0.5]
    metrics.update(diversity=3, upstream=[1, 2], gates="passed", n_prompts=True, kl_to_reference=None)
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    assert cli.main(["report", str(run)]) == 0, capsys.readouterr().err
    md = (run / "evaluate" / "report.md").read_text()
    assert ("> evaluate/metrics.json has fields of another shape than this rlaif writes, shown as n/a: "
            "n_prompts, judges.training.win_rate_ci95, judges.heldout, gates, diversity, upstream (written by another "
            "rlaif version, or edited by hand).") in md
    assert "| win rate, judge 'training' | 0.650; length-controlled 0.630; 60/10/30 W/T/L |" in md
    assert "| win rate, judge 'heldout' | n/a; length-controlled n/a; n/a/n/a/n/a W/T/L |" in md
    assert "| most common answer's share / distinct-2, tuned vs start | n/a / n/a vs n/a / n/a |" in md
    assert "| prompts (held out) | n/a |" in md and "quality gates" not in md
    assert "KL to reference (per sequence / per token) | n/a / 0.0500 |" in md  # null: not measured, not named
    md, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(_fake_run(tmp_path, "r2")))])
    assert "- **r1**: evaluate/metrics.json has fields of another shape" in md


def test_an_unreadable_evaluate_manifest_says_what_it_is(tmp_path):
    """An evaluate manifest of another schema, or cut short, read as 'evaluate has no manifest'."""
    from rlaif import __version__

    run = _full_run(tmp_path)
    path = run / "evaluate" / "manifest.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({**written, "schema_version": 99, "code_version": "9.9.9"}))
    md, _ = _build(run)
    assert (f"> These results are unverified: evaluate's manifest was written by rlaif 9.9.9 (manifest schema 99), "
            f"and this rlaif {__version__} reads schema {manifest.SCHEMA_VERSION}, so they cannot be checked against "
            "it or against the outputs they were made from. To fix: build this report with that rlaif version, or "
            "re-run evaluate with this one.") in md
    assert "has no manifest" not in md
    path.write_text(path.read_text()[:40])
    md, _ = _build(run)
    assert ("> These results are unverified: evaluate's manifest is damaged (not valid JSON: cut short or "
            "overwritten)") in md and "To fix: delete it and re-run evaluate (or the pipeline)." in md
    compared, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(_full_run(tmp_path, "ok")))])
    assert compared.splitlines()[2] == ("| evaluation | unverified: its manifest is damaged (not valid JSON: cut short "
                                        "or overwritten) | committed |")


def test_stages_run_under_a_computing_switch_are_not_taken_for_an_edited_config(tmp_path, monkeypatch):
    """Manifests do not record RLAIF_PACKING or RLAIF_DECODER, which key the stages that read them: the report tries
    each value, rather than take another switch for settings that changed."""
    monkeypatch.setenv("RLAIF_PACKING", "off")
    run = _full_run(tmp_path)
    monkeypatch.delenv("RLAIF_PACKING")
    md, _ = _build(run)
    assert "config.yaml no longer" not in md and "⚠" not in _section(md, "Provenance").split("\n_")[0]
