"""A rebuilt report and a comparison say where results are out of date: an upstream output made again or
removed anywhere up the stage graph, config.yaml edited since, metrics.json of another shape, an unreadable
manifest."""
import json

from report_helpers import CONFIG_YAML, LABEL_METRICS, build_report, fake_run, full_run, md_section, stage_key

from rlaif import report
from rlaif.io import manifest, storage


def _relaunch(run, stage, summary, config_yaml=CONFIG_YAML):
    """`rlaif launch <stage>` on a finished run: a new output of `stage` (made from the outputs above it now, keyed
    by config_yaml), which nothing below it has read."""
    from rlaif.graph import STAGE_BY_NAME

    inputs = {"prompts": "sha-of-the-prompts", **{dep: json.loads((run / dep / "manifest.json").read_text())["digest"]
                                                  for dep in STAGE_BY_NAME[stage].inputs}}
    manifest.write(storage.normalize(str(run / stage)), stage=stage, run_id=run.name, num_samples=2,
                   config_hash=stage_key(config_yaml, stage, inputs), inputs=inputs, summary=summary)


def test_a_relabelled_run_does_not_show_the_new_judge_as_the_one_behind_its_results(tmp_path):
    """`rlaif launch label` with another judge on a finished run: the win rates are still those of the policy trained
    on the old labels. The report said nothing and showed the new judge and its statistics as the run's."""
    run = full_run(tmp_path)
    relabelled = CONFIG_YAML + "label: {judge: reference}\n"
    (run / "config.yaml").write_text(relabelled)
    new_labels = {**LABEL_METRICS, "judge": "reference", "reference_agreement": 1.0}
    (run / "label" / "metrics.json").write_text(json.dumps(new_labels))
    _relaunch(run, "label", new_labels, relabelled)
    md, page = build_report(run)
    assert ("> These results were made from an earlier label output of this run, since made again: what this report "
            "shows of it (statistics, curves, settings) may not be what they were made from; whether the generate "
            "output above it is the one behind them cannot be told.") in md
    assert "> config.yaml no longer holds the settings ppo, evaluate ran with" in md  # label is keyed by both
    assert ("| labeling (training) judge | embedding (as the evaluation recorded it) ⚠ the label output now, "
            "reference (mode pairwise, principles sample), may not be the one the policy was trained on |") in md
    assert md_section(md, "Labeling").split("\n_")[-1].startswith("⚠ The label output now may not be the one")
    assert "| KL coefficient | 0.03 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| seed | 7 |" in md and "| reward-model backbone | /models/deberta-v3-base |" in md  # train_rm matches
    assert "earlier label output of this run, since made again" in page


def test_a_hand_edited_config_is_not_shown_as_the_settings_of_the_results(tmp_path):
    run = full_run(tmp_path)
    md, _ = build_report(run)
    assert "⚠" not in md_section(md, "Provenance").split("\n_")[0] and "config.yaml no longer" not in md  # as run
    (run / "config.yaml").write_text(CONFIG_YAML.replace("lr: 2.0e-05, kl_coef: 0.03", "lr: 0.5, kl_coef: 0.9"))
    md, _ = build_report(run)
    assert "> config.yaml no longer holds the settings ppo ran with (edited by hand, or a stage launched" in md
    assert "| PPO learning rate | 0.5 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| KL coefficient | 0.9 ⚠ config.yaml now, not what the evaluated stages ran with |" in md
    assert "| PPO iterations | 10 |" in md  # as ppo's manifest recorded it
    assert "| seed | 7 |" in md and "| policy (as named in the config) | Qwen/Qwen2.5-0.5B-Instruct |" in md
    assert "⚠ not the config the evaluated stages ran with |" in md and "earlier" not in md


def test_an_upstream_output_made_again_or_removed_is_flagged_through_the_stage_graph(tmp_path):
    """The stale check looked at evaluate's own inputs only: a generate made again under label, or a label output
    removed, went unnoticed (only a removed ppo output was flagged)."""
    run = full_run(tmp_path)
    _relaunch(run, "generate", {"pairs": 2048})
    md, _ = build_report(run)
    assert "> These results were made from an earlier generate output of this run, since made again" in md
    assert "earlier label output" not in md and "| labeling (training) judge | hf:judge-7b" in md
    (run / "label" / "manifest.json").unlink()  # a label re-run that did not finish
    md, _ = build_report(run)
    assert "> These results were made from an earlier label output of this run, since removed" in md
    assert ("| labeling (training) judge | embedding (as the evaluation recorded it) ⚠ the label output it was "
            "trained on is gone |") in md
    (run / "label" / "manifest.json").write_text('{"schema_version": 1, "sta')  # cut short
    md, _ = build_report(run)
    assert "earlier label output of this run, since unreadable (its manifest is damaged (not valid JSON" in md
    assert "⚠" not in md_section(md, "Reward model") and "⚠" not in md_section(md, "PPO training")


def test_a_comparison_shows_settings_stale_notes_and_judges_that_differ(tmp_path):
    storage.configure(None)
    runs = [full_run(tmp_path, name) for name in ("a", "b", "c")]
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
    cut = runs[2] / "ppo" / "metrics.jsonl"
    cut.write_text(cut.read_text()[:-30])  # cut short: its own report is refused, a comparison still compares
    assert report.compare([storage.normalize(str(run)) for run in runs])[0].startswith("| metric |")


def _config_digest() -> str:
    import hashlib

    return hashlib.sha256(CONFIG_YAML.encode()).hexdigest()[:12]


def test_metrics_of_another_shape_show_as_na_and_are_named(tmp_path, capsys):
    """Without an evaluate manifest nothing checks metrics.json's shape: fields of another shape gave IndexError
    and AttributeError tracebacks (exit 1) in the plots, the headline table and the judge rows."""
    from rlaif import cli

    run = fake_run(tmp_path)
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
    md, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(fake_run(tmp_path, "r2")))])
    assert "- **r1**: evaluate/metrics.json has fields of another shape" in md


def test_an_unreadable_evaluate_manifest_says_what_it_is(tmp_path):
    """An evaluate manifest of another schema, or cut short, read as 'evaluate has no manifest'."""
    from rlaif import __version__

    run = full_run(tmp_path)
    path = run / "evaluate" / "manifest.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({**written, "schema_version": 99, "code_version": "9.9.9"}))
    md, _ = build_report(run)
    assert (f"> These results are unverified: evaluate's manifest was written by rlaif 9.9.9 (manifest schema 99), "
            f"and this rlaif {__version__} reads schema {manifest.SCHEMA_VERSION}, so they cannot be checked against "
            "it or against the outputs they were made from. To fix: build this report with that rlaif version, or "
            "re-run evaluate with this one.") in md
    assert "has no manifest" not in md
    path.write_text(json.dumps({k: v for k, v in written.items() if k != "schema_version"}))
    md, _ = build_report(run)  # no schema at all: a malformed file, not another version's
    assert "evaluate's manifest is malformed (" in md and "written by rlaif" not in md
    path.write_text(path.read_text()[:40])
    md, _ = build_report(run)
    assert ("> These results are unverified: evaluate's manifest is damaged (not valid JSON: cut short or "
            "overwritten)") in md and "To fix: delete it and re-run evaluate (or the pipeline)." in md
    compared, _ = report.compare([storage.normalize(str(run)), storage.normalize(str(full_run(tmp_path, "ok")))])
    assert compared.splitlines()[2] == ("| evaluation | unverified: its manifest is damaged (not valid JSON: cut short "
                                        "or overwritten) | committed |")


def test_stages_run_under_a_computing_switch_are_not_taken_for_an_edited_config(tmp_path, monkeypatch):
    """Manifests do not record RLAIF_PACKING or RLAIF_DECODER, which key the stages that read them: the report tries
    each value, rather than take another switch for settings that changed."""
    monkeypatch.setenv("RLAIF_PACKING", "off")
    run = full_run(tmp_path)
    monkeypatch.delenv("RLAIF_PACKING")
    md, _ = build_report(run)
    assert "config.yaml no longer" not in md and "⚠" not in md_section(md, "Provenance").split("\n_")[0]


def test_stages_another_rlaif_build_made_are_not_compared_with_config_yaml(tmp_path):
    # Another build's schema keys other fields (one made label.openai's transport settings runtime): its keys,
    # recomputed by this build from an unchanged config.yaml, differed, and every stage read as edited by hand.
    run = full_run(tmp_path)
    for stage in ("generate", "label", "train_rm", "ppo", "evaluate"):
        path = run / stage / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "code_digest": "0" * 64}))
    (run / "config.yaml").write_text(CONFIG_YAML.replace("lr: 2.0e-05", "lr: 0.5"))
    md, _ = build_report(run)
    assert "config.yaml no longer" not in md and "| PPO learning rate | 0.5 |" in md
    assert ("not compared with the stages' cache keys: generate, label, train_rm, ppo, evaluate were made by another "
            "rlaif build") in md


def test_a_comparison_tells_judges_apart_by_their_files_not_only_their_names(tmp_path):
    # An hf judge is named after its directory: two models in directories called 'model' read as one judge, while a
    # run without the field (an older rlaif) read as a judge of its own ('n/a').
    storage.configure(None)
    runs = [full_run(tmp_path, name) for name in ("a", "b", "c")]
    for run, model in zip(runs, ("1" * 64, "2" * 64, None)):
        path = run / "evaluate" / "manifest.json"
        written = json.loads(path.read_text())
        inputs = {**written["inputs"], **({"file:label.model": model} if model else {})}
        path.write_text(json.dumps({**written, "inputs": inputs}))
    md, _ = report.compare([storage.normalize(str(run)) for run in runs[:2]])
    assert ("| win rate, judge 'training' ⚠ a different judge per run: not comparable | 0.650 (embedding; model "
            "111111111111) | 0.650 (embedding; model 222222222222) |") in md
    assert "win rate, judge 'heldout' |" in md  # its files are the same in both: comparable
    metrics = json.loads((runs[2] / "evaluate" / "metrics.json").read_text())
    del metrics["judges"]["heldout"]["judge"]
    (runs[2] / "evaluate" / "metrics.json").write_text(json.dumps(metrics))
    md, _ = report.compare([storage.normalize(str(run)) for run in (runs[0], runs[2])])
    assert "win rate, judge 'heldout' |" in md and "judge 'heldout' ⚠" not in md
