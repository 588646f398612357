"""PPO and GRPO as real processes on the tiny config: the update is the same for 1 and 2 processes and for gradient
accumulation; kill -9 of a rank, then a re-run, resumes and ends with the weights of an uninterrupted run; GRPO,
Adafactor and DeepSpeed ZeRO-2 train and export."""
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from process_output import failure
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    with tempfile.TemporaryDirectory() as scratch:  # torchrun's run directory goes, as under rlaif's launcher
        full_env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=scratch, **(env or {}))
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="module")
def updates(tmp_path_factory) -> dict:
    """{nproc: out_dir}: one launch per process count; each runs PPO and GRPO updates, and PPO under ZeRO-2, without
    and with accumulation."""
    out = {}
    for nproc in (1, 2):
        out[nproc] = tmp_path_factory.mktemp(f"updates-{nproc}")
        proc = torchrun(nproc, "tests/stages/ppo_update_worker.py", str(out[nproc]))
        assert proc.returncode == 0, failure(proc)
    return out


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_update_is_the_same_for_one_and_two_processes_and_with_accumulation(updates, algorithm):
    runs = {"one": (1, 1), "two": (2, 1), "one-accum": (1, 2), "two-accum": (2, 2)}
    weights = {name: torch.load(updates[nproc] / f"{algorithm}-accum{accum}.pt", weights_only=True)
               for name, (nproc, accum) in runs.items()}
    lora = [n for n in weights["one"] if "lora_B" in n]
    assert lora and max(weights["one"][n].abs().max().item() for n in lora) > 1e-3  # LoRA B starts at 0: it moved
    other = torch.load(updates[1] / f"{'grpo' if algorithm == 'ppo' else 'ppo'}-accum1.pt", weights_only=True)
    assert any(not torch.equal(weights["one"][n], other[n]) for n in lora)  # the algorithm switch took effect
    # Adam turns rounding-level gradient differences (a sum split across ranks) into visible update differences for
    # elements whose gradient is near zero: measured worst case 2.7e-6 after 4 steps at lr 1e-3. 1e-5 is 1% of one
    # step; a wrongly split or normalised minibatch moves weights by a whole step.
    for name in ("two", "one-accum", "two-accum"):
        for key in weights["one"]:
            torch.testing.assert_close(weights[name][key], weights["one"][key], atol=1e-5, rtol=1e-5,
                                       msg=f"{name}: {key}")


def test_deepspeed_updates_as_ddp_does_with_and_without_accumulation(updates):
    # ZeRO-2 with grad_accum_steps 2 failed in DeepSpeed's step (no gradients reduced) while 1 worked.
    # ZeRO-3 partitions the weights themselves: gathered as the export gathers them, they are DDP's too.
    expected = torch.load(updates[1] / "ppo-accum1.pt", weights_only=True)
    for nproc in (1, 2):
        for run in ("zero2-accum1", "zero2-accum2", "zero3-accum1"):
            got = torch.load(updates[nproc] / f"{run}.pt", weights_only=True)
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5,
                                           msg=f"{nproc} processes, {run}: {key}")
        ddp, zero3 = (torch.load(updates[nproc] / f"{strategy}-all-weights.pt", weights_only=True)
                      for strategy in ("ddp", "deepspeed"))
        assert ddp and not any("lora" in key for key in ddp)  # every weight, not an adapter
        for key in ddp:
            torch.testing.assert_close(zero3[key], ddp[key], atol=1e-5, rtol=1e-5,
                                       msg=f"{nproc} processes, all weights: {key}")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """generate, label and train_rm of the tiny config, once; each test copies the run directory."""
    root = tmp_path_factory.mktemp("ppo-upstream")
    for stage in ("generate", "label", "train_rm"):
        proc = subprocess.run([sys.executable, "-m", "rlaif", "launch", stage, "--config", "configs/tiny.yaml",
                               "--storage-root", f"file://{root}"], cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, failure(proc)
    return root / "tiny"


def launch_ppo(run_dir: Path, *overrides, env=None, stage: str = "ppo"):
    args = [sys.executable, "-m", "rlaif", "launch", stage, "--config", "configs/tiny.yaml",
            "--storage-root", f"file://{run_dir.parent}", "--run-id", run_dir.name]
    for item in overrides:
        args += ["--set", item]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **(env or {})))


def copy_run(upstream: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(upstream, target, ignore=shutil.ignore_patterns("ppo", "evaluate"))
    return target


SETTINGS = ("ppo.iterations=4", "ppo.checkpoint_every=1")


@pytest.fixture(scope="module")
def straight(upstream, tmp_path_factory):
    """An uninterrupted, synchronous 4-iteration run."""
    run = copy_run(upstream, tmp_path_factory.mktemp("straight"), "straight")
    done = launch_ppo(run, *SETTINGS)
    assert done.returncode == 0, failure(done)
    return run


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "ppo/metrics.jsonl").read_text().splitlines()]


def test_kill_minus_nine_of_a_rank_then_resume_matches_uninterrupted(upstream, straight, tmp_path):
    settings = SETTINGS

    crash = copy_run(upstream, tmp_path, "crash")
    machine_tmp = tmp_path / "tmp"  # the machine's temp directory, as the launcher and its processes see it
    machine_tmp.mkdir()
    killed = launch_ppo(crash, *settings, env={"RLAIF_FAULT": "ppo:2:1", "TMPDIR": str(machine_tmp)})
    assert killed.returncode != 0
    assert not (crash / "ppo/manifest.json").exists()
    assert json.loads((crash / "ppo/checkpoints/latest.json").read_text())["step"] == 2
    # the killed rank's scratch (its checkpoint's local copy, metrics) and torchrun's run directory went with it;
    # torch's kernel cache stays where it would be
    assert [path.name for path in machine_tmp.iterdir()] in ([], ["torchinductor_" + getpass.getuser()])
    resumed = launch_ppo(crash, *settings, env={"TMPDIR": str(machine_tmp)})
    assert resumed.returncode == 0, failure(resumed)
    assert "resumed from checkpoint step-00000002" in resumed.stdout + resumed.stderr
    assert [path.name for path in machine_tmp.iterdir()] in ([], ["torchinductor_" + getpass.getuser()])

    expected = load_file(str(straight / "ppo/adapter/adapter_model.safetensors"))
    got = load_file(str(crash / "ppo/adapter/adapter_model.safetensors"))
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-6, msg=key)
    rows = rows_of(crash)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # the resumed run's log is whole
    assert [r["reward_raw"] for r in rows] == pytest.approx([r["reward_raw"] for r in rows_of(straight)], abs=1e-6)
    for key in ("generate_s", "score_s", "reference_s", "update_s", "kl", "entropy", "clip_frac", "approx_kl",
                "value_loss", "explained_variance", "response_length", "reward_std", "generate_rss_mib",
                "score_rss_mib", "reference_rss_mib", "update_rss_mib"):
        assert key in rows[0], key
    assert (crash / "ppo/tensorboard").is_dir() and (crash / "ppo/reward_kl.png").stat().st_size > 1000


def test_grpo_trains_without_a_critic(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "grpo")
    proc = launch_ppo(run, "ppo.algorithm=grpo", "ppo.group_size=2", "ppo.kl_estimator=k3", "ppo.iterations=2")
    assert proc.returncode == 0, failure(proc)
    summary = json.loads((run / "ppo/manifest.json").read_text())["summary"]
    assert summary["algorithm"] == "grpo" and summary["world_size"] == 2
    peaks = summary["phase_peak_rss_mib"]  # what a pod must hold, by phase (rank 0's)
    assert set(peaks) == {"generate", "score", "reference", "update"}
    assert all(100 < mib < 8192 for mib in peaks.values())
    assert summary["peak_rss_mib"] >= max(peaks.values())  # the whole process's: loading and export too
    row = json.loads((run / "ppo/metrics.jsonl").read_text().splitlines()[-1])
    assert "kl_loss" in row and "value_loss" not in row and "explained_variance" not in row
    assert (run / "ppo/policy/model.safetensors").exists() and (run / "ppo/adapter/adapter_model.safetensors").exists()


def test_a_stage_launched_after_its_upstreams_settings_changed_is_refused(upstream, tmp_path):
    # train_rm's output was made with the tiny config's train_rm.lr: ppo launched alone under another value would
    # train on it and be cached under settings it never saw. Refused before the run's config.yaml is rewritten.
    run = copy_run(upstream, tmp_path, "stale")
    config_before = (run / "config.yaml").read_bytes()
    proc = launch_ppo(run, "train_rm.lr=0.0009")
    assert proc.returncode == 2
    assert ("stage 'ppo' reads 'train_rm', whose output in run 'stale' was made from other settings, inputs or "
            "rlaif code than this config's now") in proc.stderr
    assert (run / "config.yaml").read_bytes() == config_before and not (run / "ppo").exists()


def test_a_stale_output_edges_above_the_launched_stage_is_named_from_that_stage(upstream, tmp_path):
    # generate's sampling changed: generate, label and train_rm are all stale. The message tells the user who launched
    # ppo which output is the first stale one and what to launch, not which edge between other stages it was found on.
    run = copy_run(upstream, tmp_path, "stale-generate")
    proc = launch_ppo(run, "generate.temperature=0.61")
    assert proc.returncode == 2
    assert ("stage 'ppo' depends on 'generate' (through 'label', 'train_rm'), whose output in run 'stale-generate' was "
            "made from other settings") in proc.stderr
    assert "`rlaif launch` each stage from 'generate' to 'ppo' in order" in proc.stderr and not (run / "ppo").exists()


def test_a_first_rollout_whose_rewards_barely_differ_is_warned_of():
    # A judge that scores every response alike (std 0.0005 in a probe) trained on whitened noise without a word.
    from rlaif.training import flat_reward_warning

    assert flat_reward_warning("grpo", 4.6e-4, 64).startswith(
        "grpo: warning: the first rollout's rewards barely differ (std 0.00046 over 64 responses)")
    assert flat_reward_warning("grpo", 0.05, 64) is None


def test_a_first_rollout_sampled_near_deterministically_is_warned_of(upstream, tmp_path):
    # At ppo.temperature's floor every sampled token has probability ~1: entropy, clip fraction and the policy
    # gradient were all ~0 and the run learned nothing, silently (probe 45).
    run = copy_run(upstream, tmp_path, "cold")
    proc = launch_ppo(run, "ppo.temperature=0.0001", "ppo.iterations=1")
    assert proc.returncode == 0, failure(proc)
    assert ("ppo: warning: the first rollout was sampled near-deterministically (mean entropy "
            in proc.stdout) and "at ppo.temperature=0.0001)" in proc.stdout


def test_a_kl_weight_of_zero_builds_and_runs_no_reference(upstream, tmp_path):
    # TRL's GRPO default (beta 0): no reference pass per rollout, no frozen copy of an all-weights policy, and no KL
    # logged that nothing measured. (The frozen all-weights copy is made only where a reference is returned.)
    from rlaif.config import load_config
    from rlaif.models.policy import build_policy

    run = copy_run(upstream, tmp_path, "no-reference")
    proc = launch_ppo(run, "ppo.algorithm=grpo", "ppo.group_size=2", "ppo.kl_coef=0", "ppo.lora_rank=0",
                      "ppo.iterations=2")
    assert proc.returncode == 0, failure(proc)
    assert "no reference (kl_coef 0)" in proc.stdout + proc.stderr
    assert "near-deterministically" not in proc.stdout  # at the default temperature
    rows = rows_of(run)
    assert len(rows) == 2 and all("kl" not in row and row["kl_loss"] == 0 for row in rows)
    assert json.loads((run / "ppo/manifest.json").read_text())["summary"]["kl_last"] is None
    assert "without a KL penalty" in (run / "ppo/policy/README.md").read_text()
    for overrides, has_reference in ((["ppo.kl_coef=0"], False), (["ppo.kl_coef=0", "ppo.lora_rank=8"], False),
                                     (["ppo.kl_coef=0.01", "ppo.adaptive_kl_target=1.0"], True),
                                     (["ppo.kl_coef=0.01"], True)):
        cfg = load_config("configs/tiny.yaml", ["ppo.lora_rank=0", *overrides])
        assert (build_policy(cfg, torch.device("cpu"))[2] is not None) == has_reference, overrides


def test_deepspeed_zero2_trains_and_exports_a_loadable_policy(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "zero2")
    proc = launch_ppo(run, "ppo.strategy=deepspeed", "ppo.zero_stage=2", "ppo.iterations=2", "ppo.lora_rank=0")
    assert proc.returncode == 0, failure(proc)
    assert "FutureWarning" not in proc.stderr, proc.stderr[-3000:]  # DeepSpeed's deprecated collective, per step
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run / "ppo/policy"))
    assert sum(p.numel() for p in model.parameters()) > 10_000


def test_async_rollout_generates_one_update_behind(upstream, straight, tmp_path):
    run = copy_run(upstream, tmp_path, "async")
    proc = launch_ppo(run, *SETTINGS, "ppo.async_rollout=true")
    assert proc.returncode == 0, failure(proc)
    sync_rows, async_rows = rows_of(straight), rows_of(run)
    # Iteration 1 is generated by the initial weights in both loops; iteration 2 by the weights before update 1
    # in the asynchronous loop (the same initial weights), after it in the synchronous one.
    assert async_rows[0]["reward_raw"] == pytest.approx(sync_rows[0]["reward_raw"], abs=1e-6)
    assert async_rows[1]["reward_raw"] != pytest.approx(sync_rows[1]["reward_raw"], abs=1e-6)
    assert len(async_rows) == 4 and (run / "ppo/adapter/adapter_model.safetensors").exists()


def test_d_rlaif_reward_from_the_judge_without_the_reward_model(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "d-rlaif")
    judge = ("label.judge=rules", "label.rules.min_words=3")
    for stage in ("label", "train_rm"):  # the run's labels by this judge too: ppo alone would refuse the old ones
        assert launch_ppo(run, *judge, stage=stage).returncode == 0
    proc = launch_ppo(run, "ppo.reward=judge", *judge, "ppo.iterations=2")
    assert proc.returncode == 0, failure(proc)
    summary = json.loads((run / "ppo/manifest.json").read_text())["summary"]
    assert summary["reward"] == "judge"
    rows = rows_of(run)  # one rules check (at least 3 words): every score is -1 or +1, so a batch mean lies between
    assert all(-1.0 <= r["reward_raw"] <= 1.0 for r in rows)
    refused = launch_ppo(copy_run(upstream, tmp_path, "refused"), "ppo.reward=judge", "ppo.iterations=1")
    assert refused.returncode == 2 and "ppo.reward=judge needs label.judge hf, rules or reference" in refused.stderr


def test_a_user_error_inside_torchrun_ranks_exits_2_with_its_message(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "sizes")
    # In a pod the stage checks the batch sizes against the world it got (launch does not know it there).
    proc = launch_ppo(run, "ppo.rollout_batch_size=3", "ppo.minibatch_size=3", "ppo.grad_accum_steps=1",
                      env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "RLAIF_CLUSTER_JSON": "{}"})
    assert proc.returncode == 2, failure(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ppo.rollout_batch_size=3 must be divisible by 2 "
                                                            "processes")
    assert "Traceback" not in proc.stderr
    assert not (run / "ppo/manifest.json").exists()


def test_a_diverged_update_stops_the_stage_before_it_commits(upstream, tmp_path):
    """A KL weight inside float32 whose products are not (1e38 x KL): the losses went NaN, every later step trained
    on NaN, and the stage committed that policy, which evaluate then scored and the cache kept."""
    run = copy_run(upstream, tmp_path, "diverged")
    proc = launch_ppo(run, "ppo.kl_coef=1e38", "ppo.iterations=3")
    assert proc.returncode == 2, failure(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ppo diverged at iteration 1: ") and "NaN or infinite (the stage stops; nothing is " \
        "committed): lower ppo.lr or ppo.kl_coef" in last, last
    assert "Traceback" not in proc.stderr and not (run / "ppo/manifest.json").exists()


def test_adafactor_trains_and_exports(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "adafactor")
    proc = launch_ppo(run, "ppo.optimizer=adafactor", "ppo.iterations=2", "ppo.checkpoint_every=1")
    assert proc.returncode == 0, failure(proc)
    adapter = load_file(str(run / "ppo/adapter/adapter_model.safetensors"))
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 1e-4  # LoRA B starts at 0
    checkpoint = run / "ppo/checkpoints/step-00000001/engine.pt"
    state = torch.load(checkpoint, weights_only=True)["optimizer"]["state"]
    assert any("exp_avg_sq_row" in s for s in state.values()) and not any("exp_avg" in s for s in state.values())
    # The same run with all weights trained: the first config's adapter, checkpoints and curves go before it starts
    rerun = launch_ppo(run, "ppo.optimizer=adafactor", "ppo.iterations=1", "ppo.lora_rank=0", "ppo.checkpoint_every=0")
    assert rerun.returncode == 0, failure(rerun)
    assert sorted(p.name for p in (run / "ppo").iterdir()) == ["manifest.json", "metrics.jsonl", "policy",
                                                                "reward_kl.png", "tensorboard", "tracking.json"]
    assert len(list((run / "ppo/tensorboard").rglob("events.out.tfevents.*"))) == 1


def test_ppo_scores_with_the_distilled_student_when_asked(upstream, tmp_path):
    run = copy_run(upstream, tmp_path, "student")
    refused = launch_ppo(run, "ppo.reward_model=student", "ppo.iterations=1")
    assert refused.returncode == 2 and "ppo.reward_model=student needs a student" in refused.stderr
    student = ("train_rm.student.layers=1", "train_rm.student.max_prompts=8", "train_rm.student.max_new_tokens=6",
               "train_rm.student.batch_size=8", "train_rm.student.epochs=1")
    missing = launch_ppo(run, "ppo.reward_model=student", *student, "ppo.iterations=1")  # train_rm ran without them
    assert missing.returncode == 2 and "reads 'train_rm', whose output in run 'student' was made from other" in (
        missing.stderr), missing.stderr[-2000:]
    distilled = subprocess.run([sys.executable, "-m", "rlaif", "launch", "train_rm", "--config", "configs/tiny.yaml",
                                "--storage-root", f"file://{run.parent}", "--run-id", run.name,
                                *(a for item in student for a in ("--set", item))],
                               cwd=REPO, capture_output=True, text=True, timeout=900)
    assert distilled.returncode == 0, failure(distilled)
    proc = launch_ppo(run, "ppo.reward_model=student", *student, "ppo.iterations=2")
    assert proc.returncode == 0, failure(proc)
    assert len(rows_of(run)) == 2 and (run / "ppo/policy/config.json").exists()


def test_token_id_rewards_need_the_policys_tokenizer(upstream, tmp_path):
    # tiny.yaml's reward model is MiniLM (a WordPiece tokenizer), the policy a byte-level BPE: auto scores on text;
    # token_ids is refused before any rollout, with the fix.
    run = copy_run(upstream, tmp_path, "token-ids")
    proc = launch_ppo(run, "ppo.reward_inputs=token_ids", "ppo.iterations=1")
    assert proc.returncode == 2, failure(proc)
    assert "ppo.reward_inputs=token_ids needs the reward model's tokenizer to be the policy's" in proc.stderr
    assert not (run / "ppo/manifest.json").exists()
