import json
import random

from rlaif import report
from rlaif.io import storage


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
    assert "question &lt;3&gt;" in page and "good &amp; kind" in page  # user text is escaped
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
    a, b = _fake_run(tmp_path, "alpha"), _fake_run(tmp_path, "beta")
    md, page = report.compare([storage.normalize(str(a)), storage.normalize(str(b))])
    lines = md.splitlines()
    assert lines[0] == "| metric | alpha | beta |"
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
