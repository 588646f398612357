"""Preference-model training as real processes: torchrun with 2 ranks (gloo) against 1 process, kill -9 and
resume (with AdamW and with Adafactor), DeepSpeed ZeRO-2 on CPU. Tiny BERT backbone (dropout off, so runs are
deterministic) and synthetic labels."""
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from process_output import failure
from safetensors.torch import load_file

from rlaif.io import manifest, storage
from rlaif.io.shards import ShardWriter

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
WORDS = "rice pasta garden guitar budget email puppy compost sleep running python debt".split()


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from rlaif.models.loading import minilm_dir

    out = tmp_path_factory.mktemp("tiny-bert")
    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def write_labels(root: Path, run_id: str, n: int = 192, shard_size: int = 40) -> None:
    """Pairs where the response that repeats the prompt's topic word is preferred (a learnable rule)."""
    storage.configure(None)
    url = storage.normalize(str(root / run_id / "label"))
    rng = random.Random(0)
    with ShardWriter(url, shard_size) as w:
        for i in range(n):
            topic, other = rng.sample(WORDS, 2)
            good, bad = f"here is help with {topic} today", f"no idea about {other} sorry"
            a_good = rng.random() < 0.5
            w.write({"__key__": f"k{i:05d}", "prompt.txt": f"how do I get better at {topic}?",
                     "response_a.txt": good if a_good else bad, "response_b.txt": bad if a_good else good,
                     "label.json": {"p_a": 0.9 if a_good else 0.1}})
    manifest.write(url, stage="label", run_id=run_id, config_hash="fixture", inputs={}, shards=w.shards)


def train(root: Path, run_id: str, backbone: Path, nproc: int, *extra: str, env=None):
    write_labels(root, run_id)
    sets = [f"storage.root={root}", f"run_id={run_id}", f"train_rm.backbone={backbone}", "train_rm.batch_size=8",
            "train_rm.epochs=2", "train_rm.lr=1e-3", "train_rm.max_length=32", "train_rm.checkpoint_every=5",
            "train_rm.shuffle_buffer=64", f"train_rm.nproc={nproc}"]
    given = {item.partition("=")[0] for item in extra}  # a test's own value replaces the default (two are refused)
    sets = [item for item in sets if item.partition("=")[0] not in given] + list(extra)
    stage = (["-m", "rlaif", "stage", "train_rm", "--config", "configs/tiny.yaml"]
             + [a for s in sets for a in ("--set", s)])
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    # Under torchrun as a multi-node TrainJob's pods run it: their launcher holds the stage's lock (a stage started by
    # hand, RLAIF_CACHE_CHECKED unset, is one process that takes the lock itself).
    launched = {"RLAIF_CACHE_CHECKED": ""} if nproc > 1 else {}
    # The stage's scratch (a killed rank's too) and torchrun's run directory go, as a pod's do with it.
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([sys.executable, *launcher, *stage], cwd=REPO, capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=scratch, **launched,
                                                    **(env or {})))


def weights(root: Path, run_id: str) -> dict:
    return load_file(str(root / run_id / "train_rm" / "model" / "model.safetensors"))


def summary(root: Path, run_id: str) -> dict:
    return json.loads((root / run_id / "train_rm" / "manifest.json").read_text())["summary"]


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, backbone):
    root = tmp_path_factory.mktemp("rm-runs")
    for run_id, nproc in (("one", 1), ("two", 2)):
        proc = train(root, run_id, backbone, nproc)
        assert proc.returncode == 0, failure(proc)
    return root


def test_two_processes_match_one_process(reference_runs, backbone):
    one, two = weights(reference_runs, "one"), weights(reference_runs, "two")
    init = load_file(str(backbone / "model.safetensors"))
    assert one.keys() == two.keys()
    moved = max((one[k] - init[k]).abs().max().item() for k in one if k in init)
    assert moved > 0.01  # training moved the weights far more than the tolerance below
    for name in one:
        # Same global batches; only summation order differs (4 + 4 all-reduced vs 8 in one pass).
        torch.testing.assert_close(two[name], one[name], atol=5e-5, rtol=1e-3, msg=name)
    s1, s2 = summary(reference_runs, "one"), summary(reference_runs, "two")
    assert s2["world_size"] == 2 and s1["steps"] == s2["steps"] > 20
    assert s2["replica_param_spread"] == 0.0  # both ranks hold identical parameters
    assert s1["held_out_accuracy"] >= 0.9  # it learned the rule
    assert ((reference_runs / "two/train_rm/tensorboard").is_dir()
            and (reference_runs / "two/train_rm/metrics.jsonl").exists())


def test_kill_minus_nine_of_a_rank_then_resume_matches_uninterrupted(reference_runs, backbone):
    crashed = train(reference_runs, "crash", backbone, 2, env={"RLAIF_FAULT": "train_rm:15:1"})
    assert crashed.returncode != 0
    assert not (reference_runs / "crash/train_rm/manifest.json").exists()
    marker = json.loads((reference_runs / "crash/train_rm/checkpoints/latest.json").read_text())
    assert marker["step"] == 15
    resumed = train(reference_runs, "crash", backbone, 2)
    assert resumed.returncode == 0, failure(resumed)
    assert "resumed from checkpoint step-00000015" in resumed.stdout + resumed.stderr
    expected, got = weights(reference_runs, "two"), weights(reference_runs, "crash")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-6, msg=name)


def test_shard_split_mode_trains(reference_runs, backbone):
    proc = train(reference_runs, "shards", backbone, 2, "train_rm.data_split=shard", "train_rm.data_workers=1")
    assert proc.returncode == 0, failure(proc)
    assert summary(reference_runs, "shards")["held_out_accuracy"] >= 0.9


def test_deepspeed_zero2_with_accumulation_trains_as_ddp_and_exports_a_loadable_model(reference_runs, backbone):
    import deepspeed  # noqa: F401  (make test installs it; a missing install must fail, not skip)

    # Two micro-batches per step: DeepSpeed counts them in its own step(), which once left gradients unreduced
    # (a KeyError inside ZeRO-2's step, probe 45). The same global batches as the DDP run "two".
    proc = train(reference_runs, "zero2", backbone, 2, "train_rm.strategy=deepspeed", "train_rm.zero_stage=2",
                 "train_rm.grad_accum_steps=2", env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, failure(proc)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(reference_runs / "zero2/train_rm/model"))
    assert model.config.num_labels == 1
    expected, got = weights(reference_runs, "two"), weights(reference_runs, "zero2")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=5e-5, rtol=1e-3, msg=name)
    assert summary(reference_runs, "zero2")["held_out_accuracy"] >= 0.9


def test_gradient_accumulation_matches_one_big_batch(reference_runs, backbone):
    proc = train(reference_runs, "accum", backbone, 1, "train_rm.grad_accum_steps=2")
    assert proc.returncode == 0, failure(proc)
    expected, got = weights(reference_runs, "one"), weights(reference_runs, "accum")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=5e-5, rtol=1e-3, msg=name)


def test_lora_trains_and_exports_a_merged_model(reference_runs, backbone):
    proc = train(reference_runs, "lora", backbone, 1, "train_rm.lora_rank=4", "train_rm.lr=5e-3")
    assert proc.returncode == 0, failure(proc)
    got, init = weights(reference_runs, "lora"), load_file(str(backbone / "model.safetensors"))
    assert not any("lora" in k for k in got)  # merged into plain weights
    assert max((got[k] - init[k]).abs().max().item() for k in init if k in got and "encoder" in k) > 1e-4
    assert summary(reference_runs, "lora")["held_out_accuracy"] >= 0.8


def test_deepspeed_zero3_on_cpu_gathers_weights_for_export(reference_runs, backbone):
    proc = train(reference_runs, "zero3", backbone, 2, "train_rm.strategy=deepspeed", "train_rm.zero_stage=3",
                 "train_rm.epochs=1", env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, failure(proc)
    got, init = weights(reference_runs, "zero3"), load_file(str(backbone / "model.safetensors"))
    assert all(got[k].shape == init[k].shape for k in init if k in got)  # whole tensors, not ZeRO-3 partitions
    assert summary(reference_runs, "zero3")["held_out_accuracy"] >= 0.8


def test_adafactor_trains_and_a_killed_run_resumes_to_its_weights(tmp_path, backbone):
    settings = ("train_rm.optimizer=adafactor", "train_rm.epochs=1")
    straight = train(tmp_path, "adafactor", backbone, 1, *settings)
    assert straight.returncode == 0, failure(straight)
    assert summary(tmp_path, "adafactor")["held_out_accuracy"] >= 0.8
    checkpoints = tmp_path / "adafactor/train_rm/checkpoints"
    name = json.loads((checkpoints / "latest.json").read_text())["name"]
    state = torch.load(checkpoints / name / "engine.pt", weights_only=True)["optimizer"]["state"]
    assert any("exp_avg_sq_row" in s for s in state.values()) and not any("exp_avg" in s for s in state.values())

    crashed = train(tmp_path, "adafactor-crash", backbone, 1, *settings, env={"RLAIF_FAULT": "train_rm:10:0"})
    assert crashed.returncode != 0 and not (tmp_path / "adafactor-crash/train_rm/manifest.json").exists()
    resumed = train(tmp_path, "adafactor-crash", backbone, 1, *settings)
    assert resumed.returncode == 0, failure(resumed)
    assert "resumed from checkpoint step-00000010" in resumed.stdout + resumed.stderr
    expected, got = weights(tmp_path, "adafactor"), weights(tmp_path, "adafactor-crash")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-6, msg=name)


def test_a_distilled_student_is_exported_with_its_agreement(tmp_path, backbone):
    from transformers import AutoConfig

    from rlaif.models.reward import NormalisedScorer

    extra = ("train_rm.student.layers=1", "train_rm.student.max_prompts=24", "train_rm.student.max_new_tokens=8",
             "train_rm.student.batch_size=16", "train_rm.student.epochs=3", "train_rm.student.lr=1e-3",
             "train_rm.checkpoint_every=0")
    proc = train(tmp_path, "student", backbone, 2, *extra)
    assert proc.returncode == 0, failure(proc)
    student = summary(tmp_path, "student")["student"]
    assert student["layers"] == 1 and student["policy_samples"] == 48 and student["train_items"] > 300
    assert student["parameters"] < student["teacher_parameters"]
    # The teacher learned the topic rule; a student that learned nothing from it would agree on about half.
    assert student["pairwise_agreement"] >= 0.8 and student["spearman"] >= 0.6, student
    assert student["held_out_accuracy"] >= 0.8
    path = tmp_path / "student/train_rm/model/student"
    assert AutoConfig.from_pretrained(str(path)).num_hidden_layers == 1
    score = NormalisedScorer(path, torch.device("cpu"))
    scores = score(["how do I get better at rice?"] * 2, ["here is help with rice today", "no idea about sleep sorry"])
    assert scores[0] > scores[1]
    assert "agrees with the teacher" in proc.stdout + proc.stderr


def test_a_damaged_checkpoint_gives_way_to_the_one_before_it(reference_runs, backbone):
    """A checkpoint damaged (bytes changed in place here; cut short or a file lost in tests/unit) made every resume
    fail with a traceback, or load wrong weights: the one before it is loaded instead, to the same weights as an
    uninterrupted run; when none loads, one line names the fix."""
    crashed = train(reference_runs, "damaged", backbone, 2, env={"RLAIF_FAULT": "train_rm:15:1"})
    assert crashed.returncode != 0
    checkpoints = reference_runs / "damaged/train_rm/checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text())["history"] == ["step-00000010", "step-00000015"]
    engine = checkpoints / "step-00000015/engine.pt"
    with open(engine, "r+b") as f:  # bytes changed in place: the same size, an archive that still opens
        f.seek(engine.stat().st_size // 2)
        f.write(b"\x7f" * 8)
    resumed = train(reference_runs, "damaged", backbone, 2)  # both ranks take the same checkpoint
    assert resumed.returncode == 0, failure(resumed)
    assert ("resumed from checkpoint step-00000010 (step 10), as step-00000015 is damaged (engine.pt does not match "
            "the checksum it was saved with)") in resumed.stdout
    marker = json.loads((checkpoints / "latest.json").read_text())
    assert marker["history"] == sorted(set(marker["history"]))  # step 15 saved again, once, over the damaged one
    expected, got = weights(reference_runs, "two"), weights(reference_runs, "damaged")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-6, msg=name)

    crashed = train(reference_runs, "lost", backbone, 1, env={"RLAIF_FAULT": "train_rm:15:0"})
    assert crashed.returncode != 0
    for step in (10, 15):
        (reference_runs / f"lost/train_rm/checkpoints/step-{step:08d}/client_state.json").unlink()
    refused = train(reference_runs, "lost", backbone, 1)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: no checkpoint under "), refused.stderr[-2000:]
    assert "run the stage again from its start (`rlaif run --rerun STAGE`" in refused.stderr
