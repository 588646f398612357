"""The Kubeflow pipeline, generated from graph.py: one component per stage (components/<stage>/component.py, lightweight
Python components, so `kfp.local` can execute the real wiring without Docker and the same component runs in the
project image on a cluster), tasks wired by the graph's inputs, each task's pod from `pod.pod_plan`.

Components pass the small manifest artifacts; the shards and models stay in object storage."""

from typing import List
from urllib.parse import urlsplit

import kfp
from kfp import compiler, dsl, kubernetes
from rlaif_components.evaluate.component import evaluate
from rlaif_components.generate.component import generate
from rlaif_components.label.component import label
from rlaif_components.ppo.component import ppo
from rlaif_components.train_rm.component import train_rm

from rlaif.graph import topological_order
from rlaif.orchestration.cluster import ClusterSpec, load
from rlaif.orchestration.image_files import input_files, only_on_this_machine
from rlaif.orchestration.pod import SHM_VOLUME, PodPlan, pod_plan

COMPONENTS = {"generate": generate, "label": label, "train_rm": train_rm, "ppo": ppo, "evaluate": evaluate}


def secret_batches(plan: PodPlan) -> list[tuple[str, bool, dict[str, str]]]:
    """The plan's secret variables as kfp-kubernetes takes them: per secret and `optional`, a key -> variable map,
    so one key feeding two variables takes two maps (one map kept only the last variable, and one secret listed
    twice took the first entry's `optional` for both)."""
    batches: list[tuple[str, bool, dict[str, str]]] = []
    for ref in plan.secret_env:
        batch = next((b for b in batches if b[:2] == (ref.secret, ref.optional) and ref.key not in b[2]), None)
        if batch is None:
            batch = (ref.secret, ref.optional, {})
            batches.append(batch)
        batch[2][ref.key] = ref.env
    return batches


def configure_task(task: dsl.PipelineTask, plan: PodPlan) -> None:
    """The KFP translation of a stage's pod plan: image, resources, scheduling, secrets, /dev/shm and retries."""
    task.set_display_name(plan.stage).set_container_image(plan.image)
    memory = f"{plan.memory_gib}Gi"
    task.set_cpu_request(str(plan.cpu)).set_memory_request(memory).set_memory_limit(memory)
    # KFP's cache key would be the parameter strings, blind to the config file's and prompts' content; each stage's own
    # content-addressed cache (config sections + input digests + code version) decides instead, in seconds.
    task.set_caching_options(False)
    task.set_retry(plan.retries, backoff_duration="60s", backoff_factor=2.0)
    for name, value in sorted(plan.env.items()):
        task.set_env_variable(name, value)
    for secret, optional, key_to_env in secret_batches(plan):
        kubernetes.use_secret_as_env(task, secret, secret_key_to_env=key_to_env, optional=optional)
    kubernetes.empty_dir_mount(task, volume_name=SHM_VOLUME, mount_path="/dev/shm", medium="Memory",
                               size_limit=f"{plan.shm_gib}Gi")
    kubernetes.set_security_context(task, run_as_user=plan.run_as_user, run_as_non_root=True)
    for key, value in sorted(plan.node_selector.items()):
        kubernetes.add_node_selector(task, key, value)
    for toleration in plan.tolerations:
        kubernetes.add_toleration(task, key=toleration.key, operator=toleration.operator, value=toleration.value,
                                  effect=toleration.effect)
    if plan.gpus:
        task.set_accelerator_type(plan.gpu_resource).set_accelerator_limit(plan.gpus)


def build_pipeline(spec: "ClusterSpec | None" = None, judge: "str | None" = None, streaming: bool = False,
                   default_config: str = "configs/demo.yaml"):
    """The pipeline function: tasks in graph order, each fed its upstream stages' manifest artifacts. `judge`, the
    label judge of the config the pipeline is compiled for, decides whether label's pod gets a GPU; `streaming`
    (its label.streaming) starts label beside generate, with no edge between them, and turns streaming on in it.
    `default_config`: the `config` parameter's default, the config the pods were sized for."""
    spec = spec or ClusterSpec()
    judge_for_pods = judge  # the pipeline's `judge` parameter is a runtime value; pods are sized when compiling

    description = "RLAIF: generate -> label -> train_rm -> ppo -> evaluate (stages from rlaif/graph.py)"

    @dsl.pipeline(name="rlaif", description=description)
    def rlaif(config: str = default_config, overrides: List[str] = [], run_id: str = "",
              storage_root: str = "", policy_model: str = "", judge: str = "", ppo_lr: float = 0.0,
              kl_coef: float = -1.0, iterations: int = 0, seed: int = -1):
        """RLAIF run.

        Args:
            config: Config path or URL (s3://...; paths resolve in the image's working directory), or the YAML itself.
            overrides: KEY=VALUE strings, as with `rlaif run --set`, e.g. ppo.iterations=100.
            run_id: Run directory name under the storage root; empty means the KFP run's name, so a retry resumes it.
            storage_root: Where outputs live, e.g. s3://bucket/rlaif; empty means the config's storage.root.
            policy_model: Starting policy (policy.model): a Hub id, s3:// or image path; empty: the config's.
            judge: The label judge (label.judge): embedding, hf, openai, rules or reference; empty: the config's.
            ppo_lr: PPO learning rate (ppo.lr); 0: the config's.
            kl_coef: PPO KL coefficient (ppo.kl_coef); negative: the config's.
            iterations: PPO iterations (ppo.iterations); 0: the config's.
            seed: Seed of every random choice; negative: the config's.
        """
        typed = {"policy_model": policy_model, "judge": judge, "ppo_lr": ppo_lr, "kl_coef": kl_coef,
                 "iterations": iterations, "seed": seed}
        tasks: dict[str, dsl.PipelineTask] = {}
        for stage in topological_order():
            upstream = {f"{dep}_manifest": tasks[dep].outputs["manifest"] for dep in stage.waits_for(streaming)}
            streams = {"streaming": True} if streaming and stage.streams_from else {}
            task = COMPONENTS[stage.name](config=config, overrides=overrides, run_id=run_id, storage_root=storage_root,
                                          default_run_id=dsl.PIPELINE_JOB_NAME_PLACEHOLDER, **typed, **upstream,
                                          **streams)
            configure_task(task, pod_plan(stage, spec, judge_for_pods))
            tasks[stage.name] = task

    return rlaif


def compile_pipeline(output: str, cluster: "str | None" = None, components_dir: "str | None" = None,
                     config: "str | None" = None) -> str:
    """Writes the pipeline YAML (and optionally each stage's component YAML); returns the pipeline path. With
    `config`, pods are sized for that config (label gets no GPU when its judge runs no model) and label streams
    generate's output where the config's label.streaming says so."""
    import tempfile
    from pathlib import Path

    from rlaif.config import load_config
    from rlaif.errors import UserError
    from rlaif.io import output_files

    target = output_files.check_output_file(output, "--output", "the pipeline YAML file", "rlaif_pipeline.yaml",
                                            (".yaml", ".yml"))
    if components_dir:
        _check_components_dir(Path(components_dir))
    spec = load(cluster)
    cfg = load_config(config) if config else None
    if cfg:
        check_gpu_settings(cfg, spec)
    label = cfg.label if cfg else None
    pipeline = build_pipeline(spec, label and label.pod_judge, bool(label and label.streaming),
                              _config_on_one_line(config) if config else "configs/demo.yaml")
    try:
        if components_dir:
            for name, component in COMPONENTS.items():
                path = Path(components_dir) / name / "component.yaml"
                path.parent.mkdir(parents=True, exist_ok=True)
                compiler.Compiler().compile(component, str(path))
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        raise UserError(f"cannot write the components ({exc.strerror or exc}{where}): check --components-dir") from None
    with tempfile.TemporaryDirectory() as scratch:  # last, and whole: a pipeline file means everything was written
        compiler.Compiler().compile(pipeline, str(Path(scratch) / "pipeline.yaml"))
        output_files.write_output_file(target, (Path(scratch) / "pipeline.yaml").read_bytes(), "--output")
    return output


def _sent_config(config: str) -> str:
    """A config as a pipeline parameter: a URL as it is; a local file's text (the pods cannot read this machine's
    files), with a line end, which makes the steps read it as YAML text rather than as a path."""
    from rlaif.io import user_files

    if "://" in config and not config.lower().startswith("file://"):
        return config
    text = user_files.read_user_file(config, "config file", "give a YAML config file, e.g. configs/demo.yaml")
    return text if text.endswith("\n") else text + "\n"


def _config_on_one_line(config: str) -> str:
    """A config as the compiled pipeline's default: a URL as it is; a local file as one line of JSON (YAML too),
    since kfp writes each default into the file's comment header, where a line break would end the comment."""
    import json

    from rlaif.config.loading import load_yaml

    sent = _sent_config(config)
    if "\n" not in sent:
        return sent
    return json.dumps(load_yaml(sent, f"config file {config}") or {}, default=str)


def _check_components_dir(root) -> None:
    """Every component's directory can be made (checked before anything is written): no file where a directory
    goes, no directory where a component.yaml goes, and its parent an existing directory (the directory itself is
    made)."""
    from rlaif.errors import UserError

    directories = (root, *(root / name for name in COMPONENTS))
    for path in directories:
        if path.exists() and not path.is_dir():
            raise UserError(f"--components-dir {root}: {path} is a file: remove it or name another directory")
    for path in (root / name / "component.yaml" for name in COMPONENTS):
        if path.is_dir():
            raise UserError(f"--components-dir {root}: {path} is a directory: remove it or name another directory")
    parent = root.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"--components-dir {root}: {parent} is a file, not a directory: name another directory")
    if not parent.exists():  # as -o: a mistyped path would otherwise become a tree of new directories
        raise UserError(f"--components-dir {root}: directory {parent} does not exist: create it first")


KFP_TIMEOUT_S = 15.0  # seconds one request to the KFP API server may take (urllib3 retries a GET up to 3 times)
HEALTHZ = "/apis/v2beta1/healthz"


def check_answers(endpoint: str, timeout_s: float) -> None:
    """One bounded GET of the API server's healthz before kfp.Client is made: the client's own first request (in its
    constructor) has no time limit, so an endpoint that accepts connections and never answers would hang forever.
    An auth proxy's 401 or 403 passes (kfp.Client reports what it means); a 404 or a web page (no KFP 2 API there)
    and a 5xx are refused here. Direct, as kfp.Client ignores $HTTP_PROXY too."""
    from rlaif.errors import UserError, redact
    from rlaif.io import endpoint as http
    from rlaif.io.user_files import is_json_object

    try:
        status, body = http.get(http.without_credentials(endpoint).rstrip("/") + HEALTHZ, timeout_s, proxies=False)
    except http.NoAnswer as why:
        raise UserError(f"KFP endpoint {redact(endpoint)} {why}: check --endpoint (the KFP API server's URL) and "
                        "that the server is up and reachable from here") from None
    # kfp.Client would ask healthz 5 times, 5 s apart, printing a traceback for each, then blame a timeout.
    if status == 404 or (status == 200 and not is_json_object(body)):
        raise UserError(f"KFP endpoint {redact(endpoint)} is not a KFP 2 API server ({HEALTHZ} answered {status}"
                        f"{' with a web page' if status == 200 else ''}): give the KFP API's URL, e.g. "
                        "https://kfp.example.com/pipeline (behind an auth proxy, log in or pass its URL past it)")
    if status >= 500:
        raise UserError(f"KFP endpoint {redact(endpoint)} answered {status} at {HEALTHZ}: the KFP API server is not "
                        "ready; submit again once it is")


def bound_requests(api_client, timeout_s: float) -> None:
    """kfp.Client has no timeout setting, and its REST client passes urllib3 `timeout=None` (no limit) to every
    request not given one: each request of this client gets (connect, read) limits instead."""
    rest = api_client.rest_client
    if getattr(rest, "rlaif_timeout_s", None) is not None:
        return
    unbounded = rest.request

    def bounded(*args, _request_timeout=None, **kwargs):
        return unbounded(*args, _request_timeout=_request_timeout or (timeout_s, timeout_s), **kwargs)

    rest.request, rest.rlaif_timeout_s = bounded, timeout_s


def _timed_out(exc: Exception) -> bool:
    """A request of the kfp client that reached its time limit (urllib3 wraps it in MaxRetryError after retries)."""
    import urllib3

    return isinstance(exc, urllib3.exceptions.TimeoutError) or isinstance(
        getattr(exc, "reason", None), urllib3.exceptions.TimeoutError)


def _create_run(endpoint: str, client, timeout_s: float, pipeline, experiment: str, arguments: dict):
    """The run, created through kfp.Client (`client`, else a BoundedClient); any failure is one line."""
    import logging
    import warnings

    from rlaif.errors import UserError, one_line, redact

    try:
        with warnings.catch_warnings():  # kfp.Client warns about server versions on every construction
            warnings.simplefilter("ignore")  # and about hosts it rewrites: a failure is reported below
            logging.disable(logging.ERROR)  # and logs a traceback for each failed attempt: reported below, once
            client = client or BoundedClient(endpoint, timeout_s)
            return client.create_run_from_pipeline_func(pipeline, experiment_name=experiment, arguments=arguments)
    except Exception as exc:  # urllib3/kfp_server_api raise many types for one cause: the server did not answer
        if isinstance(exc, UserError):
            raise
        if _timed_out(exc):
            raise UserError(f"KFP endpoint {redact(endpoint)} did not answer within {timeout_s:g}s while submitting: "
                            "check that the KFP API server is up and not overloaded, then submit again") from None
        reason = one_line(exc, 160)
        raise UserError(f"KFP endpoint {redact(endpoint)} did not accept the run ({type(exc).__name__}: "
                        f"{redact(reason)}): check --endpoint and that the KFP API server is reachable") from None
    finally:
        logging.disable(logging.NOTSET)


def check_runs_on_cluster(cfg, spec: ClusterSpec) -> list[str]:
    """What only the run's pods would refuse, refused before it is submitted: batch sizes that do not split over
    the processes each stage gets on the cluster (its pod's GPUs, or its config's nproc on CPU, times its nodes).
    Returns warnings for what works only where every pod mounts this machine's paths (a shared volume a PodDefault
    adds, say): a file:// storage root, through which the stages pass their outputs, and input files only this
    machine has."""
    from rlaif.graph import STAGES
    from rlaif.io import storage
    from rlaif.io.urls import check_key_room

    root = storage.normalize(cfg.storage.root)  # a malformed root (s3:/bucket) is refused as `rlaif run` refuses it
    check_key_room(root, cfg.run_id)  # an empty run id (the KFP run's name) is counted as none: the pod checks again
    check_gpu_settings(cfg, spec)
    for stage in STAGES:
        settings = getattr(cfg, stage.name)
        if hasattr(settings, "check_processes"):
            gpus = pod_plan(stage, spec, cfg.label.pod_judge).gpus
            settings.check_processes((gpus or settings.nproc) * getattr(settings, "nodes", 1))
    warnings = []
    if root.startswith("file://"):
        warnings.append(f"warning: storage root {cfg.storage.root} is a directory each stage's pod has to itself "
                        "unless every pod mounts it (a shared volume): otherwise label finds no output of generate; "
                        "give --storage-root s3://bucket/prefix")
    local = [f"{field}={named} ({why})" for field, named in sorted(input_files(cfg).items())
             if (why := only_on_this_machine(named))]
    if local:
        warnings.append(f"warning: input files only this machine has: {'; '.join(local)}: upload them and give their "
                        "s3:// URLs, or build them into the image")
    return warnings


def check_gpu_settings(cfg, spec: ClusterSpec) -> None:
    """Settings that run on a GPU in a stage's pod, refused where that pod gets none (the run's first pod failed)."""
    from rlaif.errors import UserError
    from rlaif.graph import STAGE_BY_NAME

    if cfg.generate.backend == "vllm" and not pod_plan(STAGE_BY_NAME["generate"], spec).gpus:
        raise UserError("generate.backend=vllm runs vLLM in generate's pod, which gets no GPU on this cluster "
                        "(use_gpus false, or stages.generate.gpus 0 in the cluster settings): set "
                        "generate.backend=transformers, or give generate's pod a GPU")


class BoundedClient(kfp.Client):
    """kfp.Client whose every request to the API server is bounded by `timeout_s`, the constructor's healthz too."""

    def __init__(self, host: str, timeout_s: float):
        self._timeout_s = timeout_s
        super().__init__(host=host)
        bound_requests(self._healthz_api.api_client, timeout_s)  # where a namespace is set, the constructor asked none

    def get_kfp_healthz(self, sleep_duration: int = 5):
        bound_requests(self._healthz_api.api_client, self._timeout_s)  # all the APIs share this client
        return super().get_kfp_healthz(sleep_duration)


def submit(endpoint: str, config: str | None, overrides: list[str], run_id: str, storage_root: str,
           cluster: str | None, experiment: str, client=None, timeout_s: float = KFP_TIMEOUT_S) -> str:
    """Submits one run through kfp.Client. A local config file is sent inline (the pods cannot read this machine's
    files); an s3:// URL is passed as is. Each request to the API server may take `timeout_s` seconds."""

    from rlaif.config.loading import parse_config
    from rlaif.errors import UserError, redact
    from rlaif.orchestration.launch import load_config_source

    parts = urlsplit(endpoint.strip())
    if client is None and (parts.scheme.lower() not in ("http", "https") or not parts.hostname):  # kfp: localhost:80
        raise UserError(f"--endpoint {redact(endpoint)!r} is not an http(s) URL: give the KFP API endpoint, e.g. "
                        "https://kfp.example.com/pipeline")
    local = config and ("://" not in config or config.lower().startswith("file://"))
    if local and "\n" not in config:  # a local file (a path or a file:// URL): its text travels with the run
        path, config = config, _sent_config(config)
        parse_config(config, f"config file {path}", given=True)  # an empty one is refused as `rlaif run` does
    # Refuse a bad config here, not in the first pod; its judge sizes label's pod, its streaming wires label.
    cfg = load_config_source(config, overrides, run_id, storage_root)
    spec = load(cluster)
    warnings = check_runs_on_cluster(cfg, spec)
    pipeline = build_pipeline(spec, cfg.label.pod_judge, cfg.label.streaming)
    if client is None:
        check_answers(endpoint, timeout_s)
    run = _create_run(endpoint, client, timeout_s, pipeline, experiment,
                      {"config": config or "configs/demo.yaml", "overrides": list(overrides), "run_id": run_id,
                       "storage_root": storage_root})
    run_id = getattr(run, "run_id", None)
    if not isinstance(run_id, str) or not run_id:  # a 200 from a login page or another service, not a KFP API
        raise UserError(f"KFP endpoint {redact(endpoint)} answered without a run id: is it the KFP API (behind an "
                        "auth proxy, log in or pass its URL past the proxy)?")
    for warning in warnings:
        print(warning, flush=True)
    return run_id
