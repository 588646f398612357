"""Stage 2 end to end (in this process) with deterministic judges: what every label records, the summary's
position consistency and label histogram, low-confidence pairs dropped and counted, d-RLAIF score mode, and
malformed input shards refused with one clear error."""
import pytest
from judge_helpers import write_pairs

from rlaif.config import load_config
from rlaif.errors import UserError
from rlaif.io import manifest, shards
from rlaif.io.shards import ShardWriter
from rlaif.runner import run_stage
from rlaif.stages.common import context

PROMPTS = ["q1", "q2", "q3", "q4", "q5", "q6"]
FIRST = ["a short one", "the sea is wide and deep", "x", "one two three four", "same words here", "rivers run"]
SECOND = ["a much longer answer that keeps going", "no", "y z", "one two three", "same words here", "rivers run far"]


def label(tmp_path, *overrides):
    cfg = load_config(None, [f"storage.root=file://{tmp_path}", "label.judge=rules", "label.temperature=0.1",
                             "label.rules.required=[sea, words]", "label.rules.min_words=3", *overrides])
    write_pairs(cfg, PROMPTS, FIRST, SECOND)
    run_stage(cfg, "label")
    url = f"file://{tmp_path}/{cfg.run_id}/label"
    m = manifest.read(url)
    return m, {s["__key__"]: s["label.json"] for s in shards.read_all(url, m)}


def test_pairwise_labels_and_summary(tmp_path):
    m, labels = label(tmp_path)
    assert sorted(labels) == [f"p{i:03d}" for i in range(6)]
    for lab in labels.values():
        assert {"p_a", "p_a_order_ab", "p_a_order_ba", "principle", "judge", "position_consistent"} <= set(lab)
        assert 0 <= lab["p_a"] <= 1 and lab["p_a"] == pytest.approx(0.5 * (lab["p_a_order_ab"] + lab["p_a_order_ba"]))
    assert labels["p001"]["p_a"] > 0.99 and labels["p004"]["p_a"] == 0.5  # 'sea' and length vs 'no'; a tie
    s = m["summary"]
    assert s["pairs"] == s["pairs_judged"] == 6 and s["dropped_low_confidence"] == 0
    assert sum(s["p_a_histogram"]) == 6 and s["position_consistency"] == 1.0 and s["judge"] == "rules"
    # every stage's commit records how long the stage took and which code ran it (the report's provenance)
    from rlaif.io.digest import code_digest

    assert isinstance(m["seconds"], float) and 0 <= m["seconds"] < 600 and m["code_digest"] == code_digest()


def test_progress_counts_pairs_once_judged(tmp_path, monkeypatch, capsys):
    # The bar counted pairs as they were read into a batch: it read 32/32 before any judging, then 219 s of silence.
    import rlaif.stages.label as label_stage

    judge_batch = label_stage.label_batch

    def announced(cfg, judge, principles, batch):
        print(f"judging {len(batch)}")
        return judge_batch(cfg, judge, principles, batch)

    monkeypatch.setattr(label_stage, "label_batch", announced)
    label(tmp_path, "label.batch_size=4")
    out = capsys.readouterr().out.splitlines()
    judged = [i for i, line in enumerate(out) if line.startswith("judging")]
    assert [out[i] for i in judged] == ["judging 4", "judging 2"]
    assert [line for line in out if line.startswith("label: 6/6 pair")] and (
        out.index(next(line for line in out if line.startswith("label: 6/6 pair"))) > judged[-1])


def test_low_confidence_pairs_are_dropped_and_counted(tmp_path):
    m, labels = label(tmp_path, "label.min_confidence=0.1")
    assert "p004" not in labels and all(abs(lab["p_a"] - 0.5) >= 0.1 for lab in labels.values())
    assert m["summary"]["dropped_low_confidence"] == 6 - len(labels) > 0 and m["num_samples"] == len(labels)
    with pytest.raises(UserError, match="all 6 pairs were dropped as low-confidence"):
        # all ties
        label(tmp_path / "all", "label.min_confidence=0.1", "label.rules.required=[]", "label.rules.min_words=1")
    with pytest.raises(UserError, match="preferred neither response in every one of the 6 kept pairs"):
        # the same ties kept (min_confidence 0): nothing for the reward model to learn, and no manifest
        label(tmp_path / "ties", "label.rules.required=[]", "label.rules.min_words=1")
    assert manifest.read(f"file://{tmp_path}/ties/{load_config(None, []).run_id}/label") is None


def test_score_mode_records_each_response_score(tmp_path):
    m, labels = label(tmp_path, "label.mode=score")
    lab = labels["p001"]
    # 2 of 3 checks, 0 of 3
    assert lab["mode"] == "score" and lab["score_a"] == pytest.approx(1 / 3) and lab["score_b"] == -1.0
    assert lab["p_a"] > 0.99
    assert m["summary"]["position_consistency"] is None and m["summary"]["mode"] == "score"
    with pytest.raises(UserError, match="cannot score one response alone"):
        label(tmp_path / "embedding", "label.mode=score", "label.judge=embedding")


def test_malformed_pairs_are_refused(tmp_path):
    cfg = load_config(None, [f"storage.root=file://{tmp_path}", "label.judge=rules"])
    url = f"file://{tmp_path}/{cfg.run_id}/generate"
    with ShardWriter(url, 5) as writer:
        writer.write({"__key__": "p000", "prompt.txt": "q", "response_a.txt": "a"})
    manifest.write(url, stage="generate", run_id=cfg.run_id, config_hash=context(cfg, "generate").config_hash,
                   inputs={}, shards=writer.shards)
    with pytest.raises(UserError, match="pair p000 in .* lacks response_b.txt: re-run stage 'generate'"):
        run_stage(cfg, "label")
    assert manifest.read(f"file://{tmp_path}/{cfg.run_id}/label") is None


def test_reference_judge_labels_and_agreement_on_the_graded_pairs(tmp_path):
    """The reference judge can be the labeler; with the rules labeler, agreement with it is measured on exactly the
    pairs whose prompts carry key points (here 4 of 6), wherever they fall in a batch."""
    import json

    points = {"q1": ["longer answer"], "q2": ["sea wide"], "q3": ["x"], "q4": ["one two three four"], "q5": ["same"],
              "q6": ["rivers far"]}

    def prompts_file(name, keep):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": p, **({"key_points": points[p]} if p in keep else {})}) + "\n"
                                for p in PROMPTS))
        return path

    m, labels = label(tmp_path / "ref", f"data.prompts={prompts_file('all.jsonl', points)}", "label.judge=reference")
    assert labels["p000"]["judge"] == "reference" and labels["p000"]["p_a"] < 0.01  # only b covers "longer answer"
    assert labels["p001"]["p_a"] > 0.99 and labels["p004"]["p_a"] == 0.5  # "sea wide" vs "no"; identical answers
    s = m["summary"]
    assert s["reference_graded_pairs"] == 6 and s["reference_agreement"] == 1.0  # a judge agrees with itself
    partial = prompts_file("some.jsonl", {"q1", "q2", "q4", "q6"})
    m, _ = label(tmp_path / "rules", f"data.prompts={partial}", "label.batch_size=4")
    assert m["summary"]["reference_graded_pairs"] == 4
    assert m["summary"]["reference_clear_pairs"] <= 4 and 0 <= m["summary"]["reference_agreement"] <= 1


def test_a_judge_that_reads_no_principles_runs_without_a_constitution(tmp_path):
    """label.constitution '' with the rules judge: the same labels as with the file, under one principle named after
    the judge; a judge that applies principles refuses an empty constitution in one line before any work."""
    with_file = label(tmp_path / "file")[1]
    without = label(tmp_path / "none", "label.constitution=''")[1]
    assert {key: lab["p_a"] for key, lab in without.items()} == {key: lab["p_a"] for key, lab in with_file.items()}
    assert {lab["principle"] for lab in without.values()} == {"rules"}
    from rlaif.orchestration.preflight import check_judges

    check_judges(load_config(None, ["label.judge=rules", "label.constitution=''"]), [])
    with pytest.raises(UserError, match=r"^label.constitution is empty: judge embedding applies"):
        check_judges(load_config(None, ["label.constitution=''"]), [])
    with pytest.raises(UserError, match=r"or to '' \(this judge reads none\)"):
        check_judges(load_config(None, ["label.judge=rules", "label.constitution=/nonexistent.yaml"]), [])
