"""The `ppo` stage as a Kubeflow Pipelines component.

Fine-tunes the policy (LoRA) with PPO against the reward model, multi-process under torchrun, DDP or DeepSpeed ZeRO
(or a TrainJob for nodes > 1).

The component only wires: its body runs `rlaif.orchestration.kfp_steps.run_component`, which runs the stage exactly
as `rlaif run` does (content-addressed cache, lock, torchrun). Shards and models stay in object storage; the component
passes the small manifest artifact. See README.md beside this file."""
from typing import List

from kfp import dsl
from kfp.dsl import Artifact, Input, Output

from rlaif.orchestration.cluster import ClusterSpec


@dsl.component(base_image=ClusterSpec().image, install_kfp_package=False)
def ppo(
    config: str,
    overrides: List[str],
    run_id: str,
    storage_root: str,
    default_run_id: str,
    train_rm_manifest: Input[Artifact],
    manifest: Output[Artifact],
):
    """Fine-tunes the policy (LoRA) with PPO against the reward model, multi-process under torchrun, DDP or DeepSpeed
    ZeRO (or a TrainJob for nodes > 1).

    Args:
        config: Config path or URL (s3://...; paths resolve in the image's working directory), or the YAML itself.
        overrides: KEY=VALUE strings, as with `rlaif run --set`, e.g. ppo.iterations=100.
        run_id: Run directory name under the storage root; empty: `default_run_id`.
        storage_root: Where outputs live, e.g. s3://bucket/rlaif; empty: the config's storage.root.
        default_run_id: The run id when `run_id` is empty; the pipeline passes the KFP run's name, so a retry resumes.
        train_rm_manifest: The `train_rm` stage's manifest (from its component's `manifest` output).
        manifest: This stage's manifest (digest, files, metrics); its metadata holds the stage's storage URL.
    """
    from rlaif.orchestration.kfp_steps import run_component

    run_component("ppo", config, overrides, run_id, storage_root, default_run_id,
                  {"train_rm": train_rm_manifest}, manifest)
