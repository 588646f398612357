"""The `label` stage as a Kubeflow Pipelines component.

An AI judge labels each response pair with a position-debiased soft preference (both orders), and measures its
agreement with the reference judge.

The component only wires: its body runs `rlaif.orchestration.kfp_steps.run_component`, which runs the stage exactly
as `rlaif run` does (content-addressed cache, lock, torchrun). Shards and models stay in object storage; the component
passes the small manifest artifact. See README.md beside this file."""
from typing import List

from kfp import dsl
from kfp.dsl import Artifact, Input, Output

from rlaif.orchestration.cluster import ClusterSpec


@dsl.component(base_image=ClusterSpec().image, install_kfp_package=False)
def label(
    config: str,
    overrides: List[str],
    run_id: str,
    storage_root: str,
    default_run_id: str,
    manifest: Output[Artifact],
    generate_manifest: Input[Artifact] | None = None,
    streaming: bool = False,
    policy_model: str = "",
    judge: str = "",
    ppo_lr: float = 0.0,
    kl_coef: float = -1.0,
    iterations: int = 0,
    seed: int = -1,
):
    """An AI judge labels each response pair with a position-debiased soft preference (both orders), and measures its
    agreement with the reference judge.

    Args:
        config: Config path or URL (s3://...; paths resolve in the image's working directory), or the YAML itself.
        overrides: KEY=VALUE strings, as with `rlaif run --set`, e.g. ppo.iterations=100.
        run_id: Run directory name under the storage root; empty: `default_run_id`.
        storage_root: Where outputs live, e.g. s3://bucket/rlaif; empty: the config's storage.root.
        default_run_id: The run id when `run_id` is empty; the pipeline passes the KFP run's name, so a retry resumes.
        manifest: This stage's manifest (digest, files, metrics); its metadata holds the stage's storage URL.
        generate_manifest: The `generate` stage's manifest (its component's `manifest` output); none when streaming.
        streaming: Label generate's shards as they land (label.streaming), started beside generate instead of after.
        policy_model: Starting policy (policy.model): a Hub id, s3:// or image path; empty: the config's.
        judge: The label judge (label.judge): embedding, hf, openai, rules or reference; empty: the config's.
        ppo_lr: PPO learning rate (ppo.lr); 0: the config's.
        kl_coef: PPO KL coefficient (ppo.kl_coef); negative: the config's.
        iterations: PPO iterations (ppo.iterations); 0: the config's.
        seed: Seed of every random choice (seed); negative: the config's.
    """
    from rlaif.orchestration.kfp_steps import run_component

    typed = {"policy_model": policy_model, "judge": judge, "ppo_lr": ppo_lr, "kl_coef": kl_coef,
             "iterations": iterations, "seed": seed}
    run_component("label", config, overrides, run_id, storage_root, default_run_id,
                  {"generate": generate_manifest}, manifest, typed, streaming)
