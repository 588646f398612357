"""The Kubeflow pipeline, generated from graph.py: one lightweight Python component per stage (so `kfp.local` can
execute the real wiring without Docker, and the same component runs in the project image on a cluster), tasks
wired by the graph's inputs, resources and secrets from the cluster settings.

Components only wire: each calls `launch.kfp_component`, which runs the stage exactly as the local runner does.
Components pass the small manifest artifacts; the shards and models stay in object storage."""

from typing import List

from kfp import compiler, dsl, kubernetes
from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Output

from rlaif.graph import STAGE_BY_NAME, topological_order
from rlaif.orchestration.cluster import ClusterSpec, load

DEFAULT_IMAGE = ClusterSpec().image  # replaced per task by the cluster settings' image (set_container_image)


@dsl.component(base_image=DEFAULT_IMAGE, install_kfp_package=False)
def generate(config: str, overrides: List[str], run_id: str, storage_root: str, default_run_id: str,
             manifest: Output[Artifact]):
    from rlaif.orchestration.launch import kfp_component

    kfp_component("generate", config, overrides, run_id, storage_root, default_run_id, {}, manifest)


@dsl.component(base_image=DEFAULT_IMAGE, install_kfp_package=False)
def label(config: str, overrides: List[str], run_id: str, storage_root: str, default_run_id: str,
          generate_manifest: Input[Artifact], manifest: Output[Artifact]):
    from rlaif.orchestration.launch import kfp_component

    kfp_component("label", config, overrides, run_id, storage_root, default_run_id,
                  {"generate": generate_manifest}, manifest)


@dsl.component(base_image=DEFAULT_IMAGE, install_kfp_package=False)
def train_rm(config: str, overrides: List[str], run_id: str, storage_root: str, default_run_id: str,
             label_manifest: Input[Artifact], manifest: Output[Artifact]):
    from rlaif.orchestration.launch import kfp_component

    kfp_component("train_rm", config, overrides, run_id, storage_root, default_run_id,
                  {"label": label_manifest}, manifest)


@dsl.component(base_image=DEFAULT_IMAGE, install_kfp_package=False)
def ppo(config: str, overrides: List[str], run_id: str, storage_root: str, default_run_id: str,
        train_rm_manifest: Input[Artifact], manifest: Output[Artifact]):
    from rlaif.orchestration.launch import kfp_component

    kfp_component("ppo", config, overrides, run_id, storage_root, default_run_id,
                  {"train_rm": train_rm_manifest}, manifest)


@dsl.component(base_image=DEFAULT_IMAGE, install_kfp_package=False)
def evaluate(config: str, overrides: List[str], run_id: str, storage_root: str, default_run_id: str,
             train_rm_manifest: Input[Artifact], ppo_manifest: Input[Artifact], manifest: Output[Artifact],
             metrics: Output[Metrics], report: Output[HTML], report_markdown: Output[Markdown]):
    from rlaif.orchestration.launch import kfp_component, publish_evaluation

    result = kfp_component("evaluate", config, overrides, run_id, storage_root, default_run_id,
                           {"train_rm": train_rm_manifest, "ppo": ppo_manifest}, manifest)
    publish_evaluation(result, manifest.metadata["url"], metrics, report, report_markdown)


COMPONENTS = {"generate": generate, "label": label, "train_rm": train_rm, "ppo": ppo, "evaluate": evaluate}


def configure_task(task: dsl.PipelineTask, name: str, spec: ClusterSpec) -> None:
    """Image, resources, scheduling, secrets and retries of one stage's task, from graph.py and the cluster settings."""
    stage = STAGE_BY_NAME[name]
    r = stage.resources
    task.set_display_name(name).set_container_image(spec.image_for(stage))
    task.set_cpu_request(str(r.cpu)).set_memory_request(f"{r.memory_gib}G").set_memory_limit(f"{r.memory_gib}G")
    # KFP's cache key would be the parameter strings, blind to the config file's and prompts' content; each stage's own
    # content-addressed cache (config sections + input digests + code version) decides instead, in seconds.
    task.set_caching_options(False)
    task.set_retry(spec.retries, backoff_duration="60s", backoff_factor=2.0)
    task.set_env_variable("RLAIF_CLUSTER_JSON", spec.to_json())  # read by a multi-node stage to build its job
    for key, value in sorted(spec.env.items()):
        task.set_env_variable(key, value)
    for secret in spec.secrets:
        kubernetes.use_secret_as_env(task, secret.name, secret_key_to_env={k: v for v, k in secret.env.items()},
                                     optional=secret.optional)
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=f"{spec.shm_gib}Gi")
    kubernetes.set_security_context(task, run_as_user=spec.run_as_user, run_as_non_root=True)
    for key, value in sorted(spec.node_selector.items()):
        kubernetes.add_node_selector(task, key, value)
    gpus = spec.gpus(stage)
    if gpus:
        task.set_accelerator_type(spec.gpu_resource).set_accelerator_limit(gpus)
        for key, value in sorted(spec.gpu_node_selector.items()):
            kubernetes.add_node_selector(task, key, value)
        for t in spec.gpu_tolerations:
            kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)


def build_pipeline(spec: "ClusterSpec | None" = None):
    """The pipeline function: tasks in graph order, each fed its upstream stages' manifest artifacts."""
    spec = spec or ClusterSpec()

    @dsl.pipeline(name="rlaif", description="RLAIF: generate -> label -> train_rm -> ppo -> evaluate (stages from rlaif/graph.py)")
    def rlaif(config: str = "configs/demo.yaml", overrides: List[str] = [], run_id: str = "", storage_root: str = ""):
        """RLAIF run.

        Args:
            config: Config path or URL (s3://...; paths resolve in the image's working directory), or the YAML itself.
            overrides: KEY=VALUE strings, as with `rlaif run --set`, e.g. ppo.iterations=100.
            run_id: Run directory name under the storage root; empty means the KFP run's name, so a retry resumes it.
            storage_root: Where outputs live, e.g. s3://bucket/rlaif; empty means the config's storage.root.
        """
        tasks: dict[str, dsl.PipelineTask] = {}
        for stage in topological_order():
            upstream = {f"{dep}_manifest": tasks[dep].outputs["manifest"] for dep in stage.inputs}
            task = COMPONENTS[stage.name](config=config, overrides=overrides, run_id=run_id, storage_root=storage_root,
                                          default_run_id=dsl.PIPELINE_JOB_NAME_PLACEHOLDER, **upstream)
            configure_task(task, stage.name, spec)
            tasks[stage.name] = task

    return rlaif


def compile_pipeline(output: str, cluster: "str | None" = None, components_dir: "str | None" = None) -> str:
    """Writes the pipeline YAML (and optionally each stage's component YAML); returns the pipeline path."""
    from pathlib import Path

    from rlaif.errors import UserError

    target = Path(output)
    if target.is_dir() or target.suffix not in (".yaml", ".yml"):
        raise UserError(f"--output {output}: name the pipeline YAML file to write, e.g. rlaif_pipeline.yaml")
    if not target.parent.is_dir():
        raise UserError(f"--output {output}: directory {target.parent} does not exist: create it first")
    compiler.Compiler().compile(build_pipeline(load(cluster) if cluster else ClusterSpec()), output)
    if components_dir:
        for name, component in COMPONENTS.items():
            path = Path(components_dir) / name / "component.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            compiler.Compiler().compile(component, str(path))
    return output


def submit(endpoint: str, config: str | None, overrides: list[str], run_id: str, storage_root: str,
           cluster: str | None, experiment: str, client=None) -> str:
    """Submits one run through kfp.Client. A local config file is sent inline (the pods cannot read this machine's
    files); an s3:// URL is passed as is."""
    import warnings

    import kfp

    from rlaif.errors import UserError, redact
    from rlaif.io.storage import read_user_file
    from rlaif.orchestration.launch import load_config_source

    if config and "://" not in config and "\n" not in config:
        config = read_user_file(config, "config file", "give a YAML config file, e.g. configs/demo.yaml")
    load_config_source(config, overrides, run_id, storage_root)  # refuse a bad config here, not in the first pod
    pipeline = build_pipeline(load(cluster) if cluster else ClusterSpec())
    try:
        with warnings.catch_warnings():  # kfp.Client warns about server versions on every construction
            warnings.simplefilter("ignore", FutureWarning)
            client = client or kfp.Client(host=endpoint)
        run = client.create_run_from_pipeline_func(
            pipeline, experiment_name=experiment,
            arguments={"config": config or "configs/demo.yaml", "overrides": list(overrides), "run_id": run_id,
                       "storage_root": storage_root},
        )
    except Exception as exc:  # urllib3/kfp_server_api raise many types for one cause: the server did not answer
        if isinstance(exc, UserError):
            raise
        reason = " ".join(str(exc).split())[:160]
        raise UserError(f"KFP endpoint {redact(endpoint)} did not accept the run ({type(exc).__name__}: "
                        f"{redact(reason)}): check --endpoint and that the KFP API server is reachable") from None
    return getattr(run, "run_id", str(run))
