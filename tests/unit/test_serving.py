"""The model service's pieces without Ray: the request subset it honours, its identity check, the cache keys of runs
that use it, and the Kubernetes manifests (each object read back by the Kubernetes client's models, the serve config
by Ray Serve's own schema)."""
import os
import socket
import time
from dataclasses import replace

import pytest
import yaml

from rlaif.cli import main
from rlaif.config import PipelineConfig, load_config, parse_config, stage_config_hash
from rlaif.errors import UserError
from rlaif.orchestration.cluster import from_dict
from rlaif.serving import api, manifests
from rlaif.serving.identity import check_service, policy_digest


def test_the_request_subset():
    request = api.parse_request({"prompt": "hi", "seed": 3, "max_tokens": 5, "top_k": -1, "stop": "\n", "user": "x"})
    assert (request.prompts, request.seed, request.top_k, request.stop) == (["hi"], 3, 0, ["\n"])
    assert api.parse_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert api.parse_request({"prompt": [[1], [2, 3]], "pad_to_tokens": 7}).pad_to == 7
    for body, problem in (({"prompt": "a", "n": 2}, "n"), ({"prompt": "a", "echo": True}, "echo"),
                          ({"prompt": "a", "logprobs": 5}, "next-token scoring only"),
                          ({"prompt": []}, "empty"), ({}, "prompt"),
                          ({"prompt": "a", "temperature": -1}, "temperature"),
                          ({"prompt": ""}, "prompt 0 is empty"), ({"prompt": [[1], []]}, "prompt 1 is empty"),
                          ({"prompt": "hi\ud800"}, "lone surrogate"), ({"prompt": "a", "stop": ""}, "empty string"),
                          ({"prompt": "a", "stop": ["x", ""]}, "empty string"),
                          ({"prompt": "a", "max_tokens": True}, "yes/no"),
                          ({"prompt": "a", "max_tokens": "4"}, "max_tokens"),
                          ({"prompt": "a", "temperature": "0.5"}, "temperature"),
                          ({"prompt": [True, 5]}, "true/false"), ({"prompt": [[4], [5, False]]}, "true/false")):
        with pytest.raises(api.BadRequest, match=problem):
            api.parse_request(body)


def test_requests_checked_against_the_models_vocabulary_and_positions():
    from rlaif.serving.engine import BadRequest, Request, check_against_model

    check_against_model(Request(prompts=[[0, 99]], max_tokens=10, pad_to=20), [[0, 99]], 100, 30)
    check_against_model(Request(prompts=[[1]], max_tokens=2, pad_to=29), [[1]], 100, 30)  # the last is not fed
    for ids, request, problem in (([[1, 100]], Request([[1, 100]]), "outside the model's vocabulary"),
                                  ([[-5]], Request([[-5]]), "outside the model's vocabulary"),
                                  ([[1]], Request([[1]], max_tokens=31), "longer than the model's 30 positions"),
                                  ([[1]], Request([[1]], max_tokens=2, pad_to=30),
                                   "of 30 tokens plus 2 new tokens is longer than the model's 30")):
        with pytest.raises(BadRequest, match=problem):
            check_against_model(request, ids, 100, 30)


def test_a_request_whose_attention_cache_exceeds_the_budget_is_refused():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlaif.serving.engine import BadRequest, Request, cache_bytes_per_token, check_cache_size

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert cache_bytes_per_token(model) == 3 * 2 * 2 * 8 * 4  # layers x (keys, values) x kv heads x head dim x fp32
    assert cache_bytes_per_token(model.to(torch.bfloat16)) == 3 * 2 * 2 * 8 * 2
    from transformers import FalconConfig, FalconForCausalLM, MambaConfig, MambaForCausalLM

    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            multi_query=True, new_decoder_architecture=False))
    assert cache_bytes_per_token(falcon) == 2 * 2 * 1 * 8 * 4  # one key/value head (num_kv_heads, multi_query)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2))
    assert cache_bytes_per_token(mamba) is None  # no attention cache to bound: the service starts (it failed)
    check_cache_size(Request([[1]], max_tokens=8), [[1]], None, 1e-9)
    per_token = 384
    ids = [[1] * 10, [2] * 30]
    check_cache_size(Request(ids, max_tokens=34), ids, per_token, 2 * 64 * per_token / 2**30)  # 2 rows x 64 tokens
    for request, problem in ((Request(ids, max_tokens=35), r"2 prompts of 65 tokens"),
                             (Request(ids, max_tokens=1, pad_to=100), r"2 prompts of 101 tokens")):
        with pytest.raises(BadRequest, match=problem + ".*serve.max_request_cache_gib"):
            check_cache_size(request, ids, per_token, 2 * 64 * per_token / 2**30)


def keys(overrides):
    cfg = load_config("configs/tiny.yaml", overrides)
    return {stage: stage_config_hash(cfg, sections, {}) for stage, sections in
            (("generate", ("seed", "data", "policy", "generate")), ("label", ("seed", "data", "label")))}


def test_an_endpoint_run_is_keyed_as_its_engine_in_process():
    local = keys([])
    served = keys(["generate.backend=endpoint", "generate.endpoint.base_url=http://policy:8000/v1",
                   "generate.endpoint.concurrency=64", "label.hf.endpoint.base_url=http://judge:8000/v1"])
    assert served == local
    assert keys(["generate.backend=endpoint", "generate.endpoint.base_url=http://p:1/v1",
                 "generate.endpoint_engine=vllm"])["generate"] == keys(["generate.backend=vllm"])["generate"]
    assert keys(["generate.backend=vllm"])["generate"] != local["generate"]
    with pytest.raises(UserError, match="generate.endpoint.base_url"):
        load_config("configs/tiny.yaml", ["generate.backend=endpoint"])
    with pytest.raises(UserError, match="http"):
        load_config("configs/tiny.yaml", ["generate.endpoint.base_url=policy:8000"])


class FakeService:
    base_url, section = "http://svc/v1", "generate.endpoint"

    def __init__(self, answer):
        self.answer = answer

    def get(self, path):
        return self.answer


def test_a_service_of_another_model_or_engine_is_refused():
    cfg = PipelineConfig()
    digest = policy_digest(cfg.policy)
    good = {"data": [{"id": "rlaif-policy", "rlaif": {"model_digest": digest, "engine": "transformers"}}]}
    assert check_service(FakeService(good), "policy", digest, "transformers")["engine"] == "transformers"
    with pytest.raises(UserError, match="serves another policy"):
        check_service(FakeService(good), "policy", policy_digest(cfg.policy.model_copy(
            update={"prompt_template": "Q: {prompt}\nA:"})), "transformers")
    with pytest.raises(UserError, match="runs the transformers engine, this config expects vllm"):
        check_service(FakeService(good), "policy", digest, "vllm")
    with pytest.raises(UserError, match="is not an `rlaif serve` service"):
        check_service(FakeService({"data": [{"id": "gpt"}]}), "policy", digest, None)


def test_a_judge_service_without_exact_answer_log_probs_is_refused_before_any_work(monkeypatch):
    # An rlaif serve from before logprob_token_ids answered with the top 20 only: label cleared its output, then
    # stopped at its first batch.
    from rlaif.judges import hf
    from rlaif.serving import client, identity

    settings = load_config("configs/tiny.yaml", ["label.hf.endpoint.base_url=http://j/v1"]).label.hf
    monkeypatch.setattr(identity, "judge_digest", lambda _: "d" * 64)
    for extensions, refused in (([], True), (["pad_to_tokens", "logprob_token_ids"], False)):
        info = {"model_digest": "d" * 64, "engine": "transformers", "extensions": extensions}
        monkeypatch.setattr(client.ServiceClient, "get", lambda self, path, info=info: {"data": [{"rlaif": info}]})
        if refused:
            with pytest.raises(UserError, match="does not return a judge's exact answer log-probs .* redeploy"):
                hf.served_judge(settings)
        else:
            assert hf.served_judge(settings).base_url == "http://j/v1"
    from rlaif.serving.engine import BadRequest, Request, VLLMEngine

    with pytest.raises(BadRequest, match="logprob_token_ids is not served by the vllm engine"):  # not a silent top-k
        object.__new__(VLLMEngine).complete(Request(prompts=["x"], max_tokens=1, temperature=0, logprobs=1,
                                                    logprob_ids=[5]))


CLUSTER = from_dict({"namespace": "ml", "image": "reg/rlaif:cpu", "gpu_image": "reg/rlaif:gpu",
                     "node_selector": {"pool": "inference"}, "service_account": "rlaif",
                     "secrets": [{"name": "rlaif-hf", "optional": True, "env": {"HF_TOKEN": "token"}}]})


def deserialize(obj: dict, kind: str):
    from kubernetes.client import ApiClient

    return ApiClient()._ApiClient__deserialize(obj, kind)


def served_config(*overrides):
    return load_config("configs/tiny.yaml", ["serve.replicas=2", "serve.cpus_per_replica=2", "serve.memory_gib=6",
                                             *overrides])


def test_rayservice_manifest():
    from ray.serve.schema import ServeDeploySchema

    cfg = served_config("serve.autoscale=true", "serve.max_replicas=5", "serve.gpus_per_replica=0.5")
    (doc,) = manifests.rayservice(cfg, CLUSTER)
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]) == ("ray.io/v1", "RayService",
                                                                 {"name": "rlaif-policy", "namespace": "ml"})
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    (app,) = serve_config.applications
    assert app.import_path == "rlaif.serving.ray_app:build"
    assert parse_config(app.args["config"], "args") == cfg  # the pods serve exactly this config
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (2, 1, 5)
    worker = deserialize(workers["template"]["spec"], "V1PodSpec")
    assert worker.containers[0].image == "reg/rlaif:gpu" and worker.node_selector == {"pool": "inference"}
    assert worker.containers[0].resources.limits == {"memory": "6Gi", "nvidia.com/gpu": "1"}
    assert worker.containers[0].command is None  # KubeRay starts Ray in the image
    assert [e.name for e in worker.containers[0].env if e.value_from] == ["HF_TOKEN"]
    head = deserialize(cluster["headGroupSpec"]["template"]["spec"], "V1PodSpec")
    assert head.containers[0].image == "reg/rlaif:cpu" and not head.tolerations


def test_the_rayservice_builder_applies_the_serve_section():
    from rlaif.config import dump_config
    from rlaif.serving import ray_app

    app = ray_app.build({"config": dump_config(served_config())})
    deployment = app._bound_deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 16
    assert deployment.ray_actor_options["num_cpus"] == 2
    scaled = ray_app.build({"config": dump_config(served_config("serve.autoscale=true"))})._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 4


def test_a_service_that_loses_the_race_for_serves_controller_joins_the_winner(monkeypatch):
    """Two `rlaif serve` starting at once on a fresh cluster: the second finds Serve's controller name taken (Ray
    creates it without get_if_exists); it must join that controller, not exit. Other errors still surface."""
    from ray.exceptions import ActorAlreadyExistsError

    from rlaif.serving import ray_app

    calls = []

    def start(http_options):
        calls.append(http_options)
        if len(calls) == 1:
            raise ActorAlreadyExistsError("The name SERVE_CONTROLLER_ACTOR (namespace=serve) is already taken.")

    monkeypatch.setattr(ray_app.serve, "start", start)
    monkeypatch.setattr(ray_app.time, "sleep", lambda seconds: None)
    settings = served_config().serve
    ray_app.start_serve(settings)
    assert calls == [{"host": settings.host, "port": settings.port}] * 2

    def broken(http_options):
        raise TimeoutError("HTTP proxies not available after 10s.")

    monkeypatch.setattr(ray_app.serve, "start", broken)
    with pytest.raises(TimeoutError):
        ray_app.start_serve(settings)



def closed_port() -> int:
    """A local port nothing listens on (bound a moment, then freed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def ray_init_forbidden(monkeypatch):
    """The address must be refused before ray.init: no Ray is started or joined (nor RAY_ADDRESS read)."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail(f"ray.init reached: {args} {kwargs}"))


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_ray_address_nobody_listens_on_is_refused_at_once(capsys, ray_init_forbidden, scheme):
    """`rlaif serve --address host:port` with nothing there ran for minutes in ray.init's GCS retries."""
    address = f"{scheme}127.0.0.1:{closed_port()}"
    started = time.monotonic()
    assert main(["serve", "--config", "configs/tiny.yaml", "--address", address]) == 2
    assert time.monotonic() - started < 15  # the preflight's timeout is 10 s; a refused port answers at once
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: no Ray cluster answers at {address} (Connection refused): start the cluster there (ray start "
        "--head) or fix --address"]


def test_ray_address_from_the_environment_is_checked_too(monkeypatch, ray_init_forbidden):
    from rlaif.serving import ray_app

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port()}")
    for address in (None, "auto"):  # as in ray.init, RAY_ADDRESS stands in for these
        with pytest.raises(UserError, match="no Ray cluster answers at .* or fix RAY_ADDRESS$"):
            ray_app.connect(address)


@pytest.mark.parametrize("address", ["notanaddress", "10.0.0.5:x", "10.0.0.5:99999", "10.0.0.5:0", "::1:6379",
                                     ":6379", "bad host:6379", "ray://10.0.0.5", "http://10.0.0.5:8265", "local", ""])
def test_addresses_that_are_not_ray_cluster_addresses_are_refused(capsys, ray_init_forbidden, address):
    assert main(["serve", "--config", "configs/tiny.yaml", "--address", address]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --address {address!r} is not a Ray cluster address: give "
                                               "host:port"), err


def test_ray_address_forms_it_takes():
    from rlaif.serving.ray_app import host_port

    assert host_port("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert host_port("ray://head.svc:10001") == ("head.svc", 10001)
    assert host_port("[::1]:6379") == ("::1", 6379)


@pytest.mark.parametrize("error", [
    ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by setting "
                    "`--address` flag or `RAY_ADDRESS` environment variable."),
    ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379"), ValueError("Invalid address format: x"),
    TimeoutError("Timed out while waiting for GCS"), ConnectionError("ray client connection timeout")])
def test_rays_own_errors_joining_a_cluster_are_one_line(monkeypatch, error):
    """`--address auto` with no cluster (Ray's ConnectionError) and Ray's other join failures; and ray.init joins
    with one GCS connect try (RAY_gcs_server_port_wait_time_s), bounding an address that accepts but never answers,
    without changing the environment after it or overriding the user's own setting."""
    import ray

    from rlaif.serving import ray_app

    seen = []

    def failing_init(address, **options):
        seen.append(os.environ.get(ray_app.GCS_WAIT_ENV))
        raise error

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_app.GCS_WAIT_ENV, raising=False)
    monkeypatch.setattr(ray, "init", failing_init)
    with pytest.raises(UserError, match=r"^could not join the Ray cluster at auto \(--address\): [^\n]+; start "
                                        r"the cluster \(ray start --head\) or fix --address$") as refused:
        ray_app.connect("auto")
    assert "Please specify" not in str(refused.value)  # the first sentence of Ray's message only
    monkeypatch.setenv(ray_app.GCS_WAIT_ENV, "30")
    with pytest.raises(UserError):
        ray_app.connect("auto")
    assert seen == ["1", "30"] and os.environ[ray_app.GCS_WAIT_ENV] == "30"
    monkeypatch.delenv(ray_app.GCS_WAIT_ENV)
    with pytest.raises(UserError):
        ray_app.connect("auto")
    assert ray_app.GCS_WAIT_ENV not in os.environ


def test_deployment_service_and_hpa_manifests():
    plain = manifests.deployment(served_config(), CLUSTER)
    assert [d["kind"] for d in plain] == ["ConfigMap", "Deployment", "Service"]  # no HPA without autoscale
    config_map, dep, svc, hpa = manifests.deployment(served_config("serve.autoscale=true", "serve.max_replicas=6"),
                                                     CLUSTER)
    assert parse_config(config_map["data"]["config.yaml"], "configmap").serve.max_replicas == 6
    deployment = deserialize(dep, "V1Deployment")
    container = deployment.spec.template.spec.containers[0]
    assert container.command[:4] == ["rlaif", "serve", "--no-ray", "--config"]
    assert deployment.spec.replicas == 2 and container.resources.requests == {"cpu": "2", "memory": "6Gi"}
    assert deployment.spec.template.spec.service_account_name == "rlaif"
    assert container.readiness_probe.http_get.path == "/healthz"
    service = deserialize(svc, "V1Service")
    assert service.spec.selector == deployment.spec.selector.match_labels
    autoscaler = deserialize(hpa, "V2HorizontalPodAutoscaler")
    assert (autoscaler.spec.min_replicas, autoscaler.spec.max_replicas) == (1, 6)
    assert autoscaler.spec.scale_target_ref.name == deployment.metadata.name
    scale_to_zero = served_config("serve.autoscale=true", "serve.min_replicas=0")
    assert manifests.rayservice(scale_to_zero, CLUSTER)  # Ray Serve scales to zero; an HPA keeps one: refused
    with pytest.raises(UserError, match=r"^serve.min_replicas=0 scales to zero on Ray Serve only; .* set "
                                        r"serve.min_replicas=1, or use --manifest rayservice$"):
        manifests.deployment(scale_to_zero, CLUSTER)


def test_manifests_refuse_a_service_the_cluster_could_not_run():
    """A GPU replica on a cluster without GPUs: the manifest dropped the GPU and Ray waited for good to place a
    replica that asks for one. Serve's port on one of the Ray head's: two container ports of one number."""
    cpu_cluster = replace(CLUSTER, use_gpus=False)
    for render in (manifests.rayservice, manifests.deployment):
        with pytest.raises(UserError, match=r"^serve.gpus_per_replica=0.5 on a cluster without GPUs .use_gpus false"):
            render(served_config("serve.gpus_per_replica=0.5"), cpu_cluster)
        assert render(served_config("serve.gpus_per_replica=0"), cpu_cluster)
    for port, owner in ((8265, "the dashboard"), (6379, "the GCS"), (10001, "the Ray client server"),
                        (8080, "the metrics export"), (52365, "the dashboard agent")):
        with pytest.raises(UserError, match=f"^serve.port={port} is {owner}'s port in the Ray pods"):
            manifests.rayservice(served_config(f"serve.port={port}"), CLUSTER)
    assert manifests.deployment(served_config("serve.port=8265"), CLUSTER)  # no Ray head there
    # vLLM in a pod without a GPU (the CPU image, no device): rendered, and its replicas could never start
    for render in (manifests.rayservice, manifests.deployment):
        with pytest.raises(UserError, match=r"^serve.engine=vllm needs a GPU per replica: set serve.gpus_per_replica"):
            render(served_config("serve.engine=vllm"), CLUSTER)
        assert render(served_config("serve.engine=vllm", "serve.gpus_per_replica=1"), CLUSTER)
    # a Service name starts with a letter (DNS-1035): kubectl refused rlaif's '1policy'
    with pytest.raises(UserError, match="serve.name"):
        served_config("serve.name=1policy")


def test_service_pods_request_what_a_replica_takes(capsys):
    """Fractions of CPUs and GPUs are rounded up to whole ones per pod, and said (silently before); /dev/shm, which
    counts against the pod's memory limit, is never larger than it (an 8Gi shm in a 1Gi pod)."""
    rayservice = manifests.rayservice(served_config("serve.cpus_per_replica=0.25", "serve.memory_gib=1"), CLUSTER)[0]
    assert "note: serve.cpus_per_replica=0.25: each replica's pod requests whole CPUs" in capsys.readouterr().err
    cluster = rayservice["spec"]["rayClusterConfig"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    assert worker["volumes"][0]["emptyDir"]["sizeLimit"] == "1Gi"
    assert head["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "4Gi"},
                                                  "limits": {"memory": "4Gi"}}
    assert head["volumes"][0]["emptyDir"]["sizeLimit"] == "4Gi" and "nvidia.com/gpu" not in str(head)
    deployment = manifests.deployment(served_config("serve.cpus_per_replica=2.5"), CLUSTER)[1]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "3"


def test_serve_manifest_cli(capsys):
    assert main(["serve", "--config", "configs/tiny.yaml", "--set", "serve.model=judge", "--set",
                 "label.hf.model=/models/judge", "--manifest", "deployment"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["metadata"]["name"] for d in docs] == ["rlaif-judge"] * 3
    assert main(["serve", "--config", "configs/tiny.yaml", "--set", "serve.min_replicas=3", "--set",
                 "serve.autoscale=true"]) == 2
    assert "min_replicas (3) <= replicas (1)" in capsys.readouterr().err


def test_a_served_judge_needs_no_gpu_in_the_label_pod_and_only_pairwise_is_served():
    from rlaif.graph import STAGE_BY_NAME
    from rlaif.orchestration.pod import pod_plan
    from rlaif.orchestration.preflight import check_judges

    served = ["label.judge=hf", "label.hf.model=/models/judge", "label.hf.endpoint.base_url=http://judge:8000/v1"]
    cluster = from_dict({"gpus_per_node": 1})
    for overrides, gpus in ((served, 0), (served[:2], 1)):
        cfg = load_config("configs/tiny.yaml", overrides)
        assert pod_plan(STAGE_BY_NAME["label"], cluster, cfg.label.pod_judge).gpus == gpus
    for extra in ("label.mode=score", "ppo.reward=judge"):
        with pytest.raises(UserError, match="serves pairwise judging only"):
            check_judges(load_config("configs/tiny.yaml", [*served, extra]), [])


@pytest.mark.parametrize("model", ["runs/base/ppo/policy", "configs"])
def test_manifests_refuse_a_model_only_this_machine_has(capsys, model):
    """A relative path resolves in the image's working directory, and one on this machine is not in the pods: the
    service would fail only once deployed."""
    assert main(["serve", "--manifest", "deployment", "--config", "configs/tiny.yaml", "--set",
                 f"policy.model={model}"]) == 2
    assert "is a path on this machine, which the service's pods cannot read" in capsys.readouterr().err
    for reachable in ("s3://bucket/runs/base/ppo/policy", "/models/policy-in-the-image", "Qwen/Qwen2.5-0.5B"):
        assert main(["serve", "--manifest", "deployment", "--config", "configs/tiny.yaml", "--set",
                     f"policy.model={reachable}"]) == 0, capsys.readouterr().err


RAY_TRACEBACK = """Failed to update the deployments ['model'].
RuntimeError: Traceback (most recent call last):
  File "/venv/ray/serve/_private/replica.py", line 1867, in initialize
    await self._user_callable_wrapper.initialize_callable()
  File "/venv/ray/serve/_private/replica.py", line 4008, in _call_func_or_gen
    result = callable(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^^^^^^^^
{inner}"""
CHAINED = """  File "/repo/rlaif/serving/engine.py", line 120, in __init__
    self.model = load(path)
OSError: We couldn't connect to 'https://huggingface.co' to load the files.
Check your internet connection or see how to run the library in offline mode.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/repo/rlaif/serving/ray_app.py", line 36, in __init__
    raise UserError(f"{type(exc).__name__}: {one_line(exc)}") from exc
rlaif.errors.UserError: OSError: We couldn't connect to 'https://huggingface.co' to load the files. Check your"""


def test_a_replica_that_cannot_start_is_named_by_its_own_error():
    """`rlaif serve` shows the exception a replica's traceback ends with, in Serve's deployment message: a UserError
    without its type, another with its short type name, its first line where its message has several."""
    from rlaif.serving.ray_app import exception_line

    user = RAY_TRACEBACK.format(inner="  File \"/repo/rlaif/models/tiny.py\", line 40, in build\n    raise X(m)\n"
                                      "rlaif.errors.UserError: demonstrations file not found: data/d.jsonl (set it)")
    assert exception_line(user) == "demonstrations file not found: data/d.jsonl (set it)"
    assert exception_line(RAY_TRACEBACK.format(inner=CHAINED)) == (
        "OSError: We couldn't connect to 'https://huggingface.co' to load the files. Check your")
    cuda = RAY_TRACEBACK.format(inner="  File \"/venv/torch/cuda/__init__.py\", line 9, in init\n    x()\n"
                                      "torch.AcceleratorError: CUDA error: out of memory\nCompile with "
                                      "`TORCH_USE_CUDA_DSA` to enable device-side assertions.")
    assert exception_line(cuda) == "AcceleratorError: CUDA error: out of memory"
    assert exception_line("") is None and exception_line("Failed to update the deployments ['model'].") == (
        "Failed to update the deployments ['model'].")


def test_a_chunked_body_past_the_limit_is_refused_before_it_is_read_whole():
    """A body without a declared length (chunked transfer) was read into memory whole before its size was checked."""
    import asyncio

    class ChunkedRequest:
        headers: dict = {}
        chunks_read = 0

        async def stream(self):
            for _ in range(64):  # 64 MiB offered, in 1 MiB chunks
                self.chunks_read += 1
                yield b"x" * 2**20

    request = ChunkedRequest()
    with pytest.raises(api.BadRequest, match="more than the 16 MiB"):
        asyncio.run(api.body_within_limit(request))
    assert request.chunks_read == 17  # stopped at the first chunk past 16 MiB

    class SmallRequest(ChunkedRequest):
        async def stream(self):
            yield b'{"prompt": '
            yield b'"hi"}'

    assert asyncio.run(api.body_within_limit(SmallRequest())) == b'{"prompt": "hi"}'


def test_ray_started_here_needs_its_port_free_and_its_replicas_to_fit_this_machine(capsys, ray_init_forbidden):
    """Ray's HTTP proxy binds with SO_REUSEPORT: a second service on a port another holds shared it (each answering
    some requests), or ended in Ray's traceback where a plain server held it; replicas beyond the cores waited
    unscheduled without a word. Both are refused before Ray starts."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--config", "configs/tiny.yaml", "--set", f"serve.port={port}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: cannot listen on 127.0.0.1:{port}"), err
    cpus = os.cpu_count()
    assert main(["serve", "--config", "configs/tiny.yaml", "--set", f"serve.port={closed_port()}",
                 "--set", f"serve.replicas={cpus + 1}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: serve.replicas={cpus + 1} x serve.cpus_per_replica=1 needs {cpus + 1} CPUs, more than this "
        f"machine's {cpus} for the Ray started here: lower them, or join a cluster with room (--address)"]
