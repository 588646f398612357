"""The run report: its blocks, plots, examples, verdicts and run comparisons, from run directories as rlaif
writes them (report_helpers.py)."""
import json

from report_helpers import CONFIG_YAML, build_report, crafted_examples, fake_run, full_run, md_section, write_manifests

from rlaif import report
from rlaif.io import manifest, storage


def test_report_embeds_plots_judges_and_escaped_examples(tmp_path):
    storage.configure(None)
    run = fake_run(tmp_path)
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
    run = fake_run(tmp_path, gates={"checked": True, "passed": False,
                                     "failures": ["win rate 0.650 < evaluate.min_win_rate 0.9"]})
    page = storage.local_path(report.write(storage.normalize(str(run)))).read_text()
    assert 'class="fail"' in page and "min_win_rate 0.9" in page


def test_compare_runs_side_by_side(tmp_path):
    storage.configure(None)
    a = fake_run(tmp_path, "alpha")
    b = fake_run(tmp_path, "beta", gates={"checked": True, "passed": False, "failures": ["win rate 0.650 < 0.9"]})
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


def test_provenance_names_models_settings_code_and_stage_times(tmp_path):
    import hashlib

    from rlaif import __version__
    from rlaif.io.digest import code_digest

    run = full_run(tmp_path)
    md, page = build_report(run)
    block = md_section(md, "Provenance")
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
    times = md_section(md, "Stage times")
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
    md, page = build_report(full_run(tmp_path))
    rm = md_section(md, "Reward model")
    for line in ("| held-out pairs (training pairs) | 100 (900) |", "| accuracy against the AI labels | 0.812 |",
                 "| accuracy on confident pairs (\\|p - 0.5\\| >= 0.25) | 0.938 |",
                 "| accuracy against the reference judge | 0.765 on 64 clear pairs |",
                 "| soft cross-entropy (ln 2 = 0.693 is chance) | 0.432 |",
                 "| calibration MAE, mean \\|sigmoid(r_a - r_b) - p\\| | 0.123 |"):
        assert line in rm, line
    label = md_section(md, "Labeling")
    for line in ("| pairs judged / kept / dropped as low-confidence | 1024 / 1000 / 24 |",
                 "| position consistency (both orders prefer the same answer) | 0.876 |",
                 "| agreement with the reference judge | 0.912 on 700 clear pairs (of 1024 graded) |",
                 "| mean p(a) | 0.488 |", "| p(a) histogram (10 bins from 0 to 1) | 300 · 70 · 50 · 50"):
        assert line in label, line
    assert "<h2>Reward model</h2>" in page and "0.765 on 64 clear pairs" in page and "0.912 on 700 clear pairs" in page


def test_ppo_diagnostics_plot_and_last_values(tmp_path):
    run = full_run(tmp_path)
    md, page = build_report(run)
    block = md_section(md, "PPO training")
    for line in ("| policy entropy (per token) | 1.5 | 0.6 |", "| answers ending with EOS | 0.55 | 1 |",
                 "| clipped ratio fraction | 0.01 | 0.1 |", "| value loss | 1 | 0.1 |",
                 "| approx. KL to the rollout policy | 0.001 | 0.01 |", "| reward-model score | 0.1 | 1 |"):
        assert line in block, line
    assert "2.50 s per iteration" in block and "![ppo_diagnostics.png](plots/ppo_diagnostics.png)" in block
    assert (run / "evaluate" / "plots" / "ppo_diagnostics.png").read_bytes().startswith(b"\x89PNG")
    assert page.count("data:image/png;base64,") == 4 and 'alt="ppo_diagnostics.png"' in page


def test_examples_are_chosen_to_teach(tmp_path):
    from rlaif.report.examples import choose

    picks, notes = choose(crafted_examples(), 3)
    assert [p.example["id"] for p in picks] == ["p10", "p11", "p12"] and notes == []
    assert picks[0].why == "judges disagree: P(tuned better) 'training' 0.95, 'heldout' 0.05"
    assert picks[1].why == "biggest reward gain: +4.000" and picks[2].why == "biggest reward loss: -3.000"

    md, page = build_report(full_run(tmp_path))  # evaluate.n_examples: 6 in the run's config
    examples = md_section(md, "Examples")
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
    md, page = build_report(full_run(tmp_path))
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

    run = fake_run(tmp_path, "old")
    (run / "label").mkdir()
    write_manifests(run, with_times=False)
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
    times = md_section(md, "Stage times")
    assert "| generate | 9.0 s (the stage's work only) |" in times
    assert "| ppo | 25.0 s (the stage's work only) |" in times
    assert "| train_rm | n/a |" in times and "| label | at most 0.0 s (since the previous commit) |" in times
    examples = md_section(md, "Examples")
    assert examples.count("### ") == 8 and "nothing to choose by" in examples and "One judge only" in examples
    assert sorted(p.name for p in (run / "evaluate" / "plots").iterdir()) == ["ppo_reward_kl.png", "win_rate.png"]


def test_a_rebuilt_report_says_where_its_results_are_out_of_date(tmp_path):
    # after a re-run that changed ppo and was interrupted: evaluate's results are of the old ppo output
    from rlaif.io import manifest

    run = full_run(tmp_path)
    url = storage.normalize(str(run / "evaluate"))
    recorded = json.loads((run / "ppo" / "manifest.json").read_text())["digest"]
    manifest.write(url, stage="evaluate", run_id=run.name, config_hash="evaluate-key", num_samples=1, summary={},
                   inputs={"ppo": recorded, "train_rm": "digest-of-another-train_rm", "prompts.jsonl": "a-file"})
    md, _ = build_report(run)
    assert "earlier train_rm output of this run, since made again" in md and "earlier ppo output" not in md
    (run / "ppo" / "manifest.json").unlink()  # ppo re-running, interrupted
    md, _ = build_report(run)
    assert "earlier ppo output of this run, since removed" in md
    (run / "evaluate" / "manifest.json").unlink()
    md, _ = build_report(run)
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
    run, other = fake_run(tmp_path), fake_run(tmp_path, "r2")
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
    run = fake_run(tmp_path / "a")
    metrics = json.loads((run / "evaluate" / "metrics.json").read_text())
    metrics["judges"]["training"]["win_rate_ci95"] = [0.8, 0.9]  # the rate 0.65 outside it
    metrics["win_rate"], metrics["kl_to_reference"] = "high", None
    (run / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    report.write(storage.normalize(str(run)))
    md, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(fake_run(tmp_path / "b")))])
    assert md.splitlines()[0] == "| metric | a/r1 | b/r1 |"
    assert any(line.startswith("| win_rate | - | 0.650 |") for line in md.splitlines())
