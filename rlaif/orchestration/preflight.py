"""The checks a launcher makes before any stage runs: cheap ones that refuse a config, an input or a machine that
would fail later (a missing package, a model directory without a tokenizer, more processes than cores, a judge
without its key), so a user hears of it in one line before generate and label have spent their time."""
from __future__ import annotations

import functools
import glob
import os
from pathlib import Path

from rlaif import tracking
from rlaif.config import PipelineConfig, check_switches
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME, Stage
from rlaif.io import output_files, storage
from rlaif.io.prompts import check_splits, load_prompts, read_demonstrations
from rlaif.io.urls import check_key_room
from rlaif.stages import common

TRACKED = ("train_rm", "ppo")  # the stages that open the trackers


def check(cfg: PipelineConfig, pipeline: bool = False, launched: str | None = None) -> None:
    """Cheap checks before any work. `pipeline`: the whole graph will run, so both prompt splits must hold prompts
    (evaluate, the last stage, reads the eval split). `launched`: the one stage launched, whose upstream outputs must
    be there and made from this config before the run's config is rewritten."""
    check_switches()
    storage.configure(cfg.storage.endpoint_url)
    root = storage.normalize(cfg.storage.root)
    check_key_room(root, cfg.run_id)
    output_files.check_writable(root)
    prompts = load_prompts(cfg.data)
    check_judges(cfg, prompts)
    check_models(cfg)
    check_packages(cfg)
    tracking.check_settings(cfg.tracking)
    if (pipeline or launched in TRACKED) and not in_stage_pod():  # a stage's pod has its own secrets: it checks
        tracking.check_wandb_credentials(cfg.tracking)
    if pipeline:
        check_splits(cfg.data, prompts)
        check_enough_pairs(cfg, prompts)
        from rlaif.models.prompt_text import check_prompts_fit

        check_prompts_fit(cfg, prompts)
    for stage in STAGE_BY_NAME.values():
        nproc = getattr(getattr(cfg, stage.name), "nproc", 1)
        if stage.resources.torchrun and nproc > (os.cpu_count() or 1) and not _has_gpus():
            raise UserError(f"{stage.name}.nproc={nproc} is more than this machine's {os.cpu_count()} CPU cores: "
                            "lower it (on GPU machines one process per GPU is used instead)")
        nodes = getattr(getattr(cfg, stage.name), "nodes", 1)
        if nodes > 1 and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise UserError(f"{stage.name}.nodes={nodes} needs a Kubernetes cluster with Kubeflow Trainer: submit the "
                            f"pipeline to KFP or Airflow, or set {stage.name}.nodes=1 to run here")
        # Before the stages ahead of it run, where this machine runs it; in a pod (KFP, Airflow, a TrainJob) the
        # stage's own pod knows its GPUs, and the stage checks there.
        settings = getattr(cfg, stage.name)
        if hasattr(settings, "check_processes") and not in_stage_pod():
            settings.check_processes(processes_per_node(stage, cfg))
    if launched is not None:
        common.start_context(cfg, launched)


def check_enough_pairs(cfg: PipelineConfig, prompts: list[dict]) -> None:
    """train_rm's batch against the most pairs generate can make (one per training prompt, at most
    generate.max_prompts), before generate and label run rather than at train_rm."""
    from rlaif.io.prompts import split_rows

    training_prompts = len(split_rows(prompts, cfg.data, "train"))
    capped = cfg.generate.max_prompts is not None and cfg.generate.max_prompts < training_prompts
    train_pairs = cfg.train_rm.training_pairs(min(training_prompts, cfg.generate.max_prompts or training_prompts))
    if train_pairs < cfg.train_rm.batch_size:
        more = "raise generate.max_prompts" if capped else "add prompts, lower data.eval_fraction"
        source = (f"generate.max_prompts={cfg.generate.max_prompts} of the {training_prompts} training prompts"
                  if capped else f"{training_prompts} of the {len(prompts)} prompts are training prompts at "
                  f"data.eval_fraction={cfg.data.eval_fraction:g}")
        raise UserError(f"at most {train_pairs} training pairs for train_rm.batch_size={cfg.train_rm.batch_size} "
                        f"({source}; one pair per training prompt, {cfg.train_rm.held_out_fraction:g} of them held "
                        f"out): {more}, lower train_rm.held_out_fraction, or lower train_rm.batch_size")



# NVIDIA (containers, MIG and CDI included), ROCm, CUDA under WSL, Jetson's integrated GPU
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu/igpu0")


def gpu_count() -> int:
    """The GPUs torch can use here. Without a GPU device file there are none, and the launcher need not import torch
    (seconds, in a process that runs no model) to learn so."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has_gpus() -> bool:
    return gpu_count() > 0


def check_judges(cfg: PipelineConfig, prompts: list[dict]) -> None:
    """The judges' settings that can be checked before any work: constitutions readable, required fields set."""
    from rlaif.judges.constitution import judge_principles
    from rlaif.judges.prompting import load_few_shot

    for where, judge in (("label", cfg.label), *((j.setting, j) for j in cfg.evaluate.judges)):
        judge_principles(judge)
        if judge.judge in ("hf", "openai"):
            load_few_shot(judge.few_shot)
        if judge.judge == "hf" and not judge.hf.model:
            raise UserError(f"{where}: judge 'hf' needs {where}.hf.model, a Hugging Face causal-LM directory")
        if judge.judge == "openai" and not (judge.openai.base_url and judge.openai.model):
            raise UserError(f"{where}: judge 'openai' needs {where}.openai.base_url and {where}.openai.model")
        key_env = judge.openai.api_key_env
        if judge.judge == "openai" and key_env and not os.environ.get(key_env):
            flag = " (--set \"label.openai.api_key_env=''\")" if where == "label" else ""
            raise UserError(f"{where}: the endpoint judge's API key variable ${key_env} is not set: export it (on "
                            f"a cluster: the rlaif-judge secret), or set {where}.openai.api_key_env to ''{flag} for a "
                            "server without keys")
    scorers = ("hf", "rules", "reference")
    if cfg.label.mode == "score" and cfg.label.judge not in scorers:
        raise UserError(f"label.mode=score needs a judge that scores one response alone (hf, rules or reference), not "
                        f"{cfg.label.judge}")
    if cfg.ppo.reward == "judge" and cfg.label.judge not in scorers:
        raise UserError(f"ppo.reward=judge needs label.judge hf, rules or reference (they score one response alone), "
                        f"not {cfg.label.judge}")
    served = cfg.label.pod_judge == "served"
    if served and (cfg.label.mode == "score" or cfg.ppo.reward == "judge"):
        raise UserError("label.hf.endpoint serves pairwise judging only (score mode and ppo.reward=judge read whole "
                        "continuations): run the judge in-process (empty label.hf.endpoint.base_url)")
    from rlaif.judges.reference import check_points, reference_points

    check_points(prompts)  # evaluate grades with the reference judge wherever every prompt has references
    if "reference" in (cfg.label.judge, *(j.judge for j in cfg.evaluate.judges)):
        missing = len(prompts) - len(reference_points(prompts))
        if missing:
            raise UserError(f"judge 'reference' needs key points on every prompt; {missing} of {len(prompts)} in "
                            f"{cfg.data.prompts} have none: add a 'key_points' list or a 'reference' answer to them")


def check_label_pod(cfg: PipelineConfig) -> None:
    """A label pod sized without a GPU for a judge that runs no model (the config the pipeline was compiled for) gets
    a config whose judge loads its model here (the pipeline's `judge` parameter, or another config): refused, where
    a multi-billion-parameter judge on the pod's CPUs would run for days."""
    from rlaif.orchestration.pod import SIZED_FOR_JUDGE_ENV

    sized_for = os.environ.get(SIZED_FOR_JUDGE_ENV)
    if sized_for and cfg.label.pod_judge == "hf" and not _has_gpus():
        raise UserError(f"label's judge hf runs its model in this pod, which was sized without a GPU for judge "
                        f"'{sized_for}': compile the pipeline for this config (`rlaif compile kfp --config`, or "
                        "RLAIF_LABEL_JUDGE=hf for the DAGs), or serve the judge (label.hf.endpoint)")


def check_models(cfg: PipelineConfig) -> None:
    """Local model directories the stages will load (policy, hf judges, reward-model backbone), checked before any
    work; hub models are resolved to a commit now (downloaded by the stage that loads them); s3:// ones are checked
    when downloaded. The model cache must be writable where something will be written to it."""
    from rlaif.models.loading import TINY_LLAMA, check_backbone_fits

    # (role, model setting, trust_remote_code, what else a local copy must pass for that role)
    roles = [("policy model", cfg.policy.model, cfg.policy.trust_remote_code, None),
             ("reward-model backbone", cfg.train_rm.backbone, False,
              lambda path: check_backbone_fits(cfg.train_rm, path)),  # the policy's lengths: check_prompts_fit
             *(("judge model", judge.hf.model, judge.hf.trust_remote_code,
                functools.partial(check_judge_model, settings=judge))
               for judge in (cfg.label, *cfg.evaluate.judges) if judge.judge == "hf")]
    local = {}
    for role, spec, trust_remote_code, role_check in roles:
        local[role] = path = checked_model(role, spec, trust_remote_code)
        if path is not None and role_check is not None:
            role_check(path)
    check_reward_inputs(cfg, local["policy model"], local["reward-model backbone"])
    if cfg.policy.model == TINY_LLAMA:
        read_demonstrations(cfg.policy.tiny.demonstrations)
    # s3:// models, and with an s3:// root the stages' own models and checkpoints, are downloaded there; the built-in
    # policy is built there once
    if not storage.is_local(cfg.storage.root) or any(spec.startswith("s3://") for _, spec, *_ in roles) or (
            any(spec == TINY_LLAMA for _, spec, *_ in roles) and not tiny_policy_built(cfg)):
        check_model_cache_writable()


def check_reward_inputs(cfg: PipelineConfig, policy: Path | None, backbone: Path | None) -> None:
    """ppo.reward_inputs=token_ids, where both tokenizers are here (a local or built-in policy, built or not, and
    backbone): one tokenizer, or refused now."""
    from rlaif.models.loading import TINY_LLAMA, load_tokenizer

    if cfg.ppo.reward_inputs != "token_ids" or cfg.ppo.reward != "reward_model" or backbone is None:
        return
    from rlaif.models.reward import check_one_tokenizer

    if policy is not None:
        check_one_tokenizer(load_tokenizer(policy, cfg.policy.trust_remote_code), backbone)
    elif cfg.policy.model == TINY_LLAMA:
        from rlaif.models.tiny import tiny_tokenizer

        check_one_tokenizer(tiny_tokenizer(cfg.policy), backbone)


# (setting, the value that needs a package, the package to import, the extra that installs it)
OPTIONAL_PACKAGES = [("optimizer", "adamw_8bit", "bitsandbytes", "bnb"),
                     ("strategy", "deepspeed", "deepspeed", "deepspeed")]


def in_stage_pod() -> bool:
    """A pod the pipeline started for a stage (a KFP or Airflow step, a TrainJob's: the pod plan gives each the
    cluster settings), where each stage checks the GPUs and packages its own pod has. `rlaif run` in any other pod
    (a notebook server) runs every stage on that machine and checks them there."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("RLAIF_CLUSTER_JSON"))


def check_packages(cfg: PipelineConfig) -> None:
    """The optional packages the training stages' settings need are installed on this machine, which runs them:
    refused before generate and label, not where the stage builds its optimizer. (In a pod, where each stage has
    its own image, the stage checks its own.)"""
    import importlib.util

    if in_stage_pod():
        return
    for stage in ("train_rm", "ppo"):
        for setting, value, package, extra in OPTIONAL_PACKAGES:
            if getattr(getattr(cfg, stage), setting) == value and importlib.util.find_spec(package) is None:
                raise UserError(f"{stage}.{setting}={value} needs {package}: pip install 'rlaif[{extra}]', or choose "
                                f"another {stage}.{setting}")


def checked_model(role: str, spec: str, trust_remote_code: bool) -> Path | None:
    """The local directory of model setting `spec` once its files pass the checks for `role` (the built-in MiniLM's
    too); None for a hub id (resolved to a commit now), an s3:// path (checked when downloaded) or a built-in model
    that is built later."""
    from rlaif.io import hub
    from rlaif.models.files import check_model_files
    from rlaif.models.loading import (
        CAUSAL_LM_ROLES,
        MINILM,
        check_buildable,
        check_builtin,
        check_causal_lm,
        check_tokenizer_files,
        minilm_dir,
        quiet_transformers,
    )

    check_builtin(spec, role)
    if hub.parse(spec):
        hub.commit(spec, role)
        return None
    if spec.startswith("s3://"):  # its files are checked when downloaded; that it is there and readable, now
        from rlaif.io import storage, user_files

        with user_files.user_read_errors(spec, role, "check the model's s3:// path and the storage credentials"):
            if not storage.exists(spec.rstrip("/") + "/config.json"):
                raise UserError(f"{role} {spec} holds no config.json: name a directory saved with save_pretrained")
        return None
    if spec.startswith("builtin:"):
        return minilm_dir() if spec == MINILM else None
    path = check_model_files(Path(spec.removeprefix("file://")).expanduser(), role)
    quiet_transformers()  # its warnings on a config's fields would precede the one line that refuses it
    if role in CAUSAL_LM_ROLES:
        check_causal_lm(path, role)
    check_tokenizer_files(path, role, trust_remote_code)
    check_buildable(path, role, trust_remote_code)
    return path


def check_judge_model(path: Path, settings) -> None:
    """An hf judge's answer tokens, and room in its positions for the rationale it writes."""
    from rlaif.judges.hf import check_answer_tokens, judge_positions  # imports torch: only for a local hf judge

    check_answer_tokens(path, settings.hf.trust_remote_code)
    judge_positions(settings, path)


def tiny_policy_built(cfg: PipelineConfig) -> bool:
    """Is the built-in policy of this config in the model cache already? (Then a read-only cache, an image's layer
    or a mount prepared once, serves it.)"""
    from rlaif.models.tiny import built, tiny_policy_dir

    return built(tiny_policy_dir(cfg.policy))


def check_model_cache_writable() -> None:
    """The model cache (RLAIF_CACHE) can be written, before any stage builds or downloads a model into it."""
    from rlaif.io.storage import cache_dir

    try:
        (cache_dir() / "models").mkdir(parents=True, exist_ok=True)
        probe = cache_dir() / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"model cache {cache_dir()} is not writable ({exc.strerror}): set RLAIF_CACHE to a writable "
                        "directory") from None


def processes_per_node(stage: Stage, cfg: PipelineConfig) -> int:
    """One rank per visible GPU; on CPU, the stage config's nproc."""
    if not stage.resources.torchrun:
        return 1
    return gpu_count() or getattr(cfg, stage.name).nproc
