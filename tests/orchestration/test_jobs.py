"""Multi-node stages: the TrainJob / PyTorchJob specs generated from graph.py, and the create-and-wait loop against
a fake Kubernetes API that records calls and walks the job through its conditions."""
import json
import re

import pytest

from rlaif.config import load_config, safe_run_id
from rlaif.errors import Terminated, UserError
from rlaif.graph import STAGE_BY_NAME
from rlaif.orchestration import jobs
from rlaif.orchestration.cluster import ClusterSpec
from rlaif.stages.common import LAUNCHED_CONFIG, launched_config


@pytest.fixture
def cfg():
    return load_config("configs/tiny.yaml", ["run_id=Exp_1", "ppo.nodes=4"])


def test_trainjob_spec(cfg):
    spec = ClusterSpec(gpus_per_node=8, env={"AWS_ENDPOINT_URL": "http://minio:9000"})
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "s3://b/r/Exp_1/config.yaml", 4, spec, "team-a")
    assert body["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and body["kind"] == "TrainJob"
    assert re.fullmatch(r"rlaif-exp-1-[0-9a-f]{8}-ppo", body["metadata"]["name"])
    assert body["metadata"]["namespace"] == "team-a"
    trainer = body["spec"]["trainer"]
    assert body["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["command"] == ["torchrun", "-m", "rlaif", "stage", "ppo", "--config", "s3://b/r/Exp_1/config.yaml"]
    assert trainer["image"] == spec.gpu_image
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e for e in trainer["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "rlaif-storage", "key": "secret_key",
                                                                         "optional": False}
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]


def test_pytorchjob_spec(cfg):
    spec = ClusterSpec(multinode_api="pytorchjob", gpu_node_selector={"gpu": "a100"}, service_account="rlaif-runner")
    body = jobs.job_manifest(STAGE_BY_NAME["train_rm"], cfg, "s3://b/c.yaml", 3, spec, "default")
    assert body["apiVersion"] == "kubeflow.org/v1" and body["kind"] == "PyTorchJob"
    replicas = body["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    pod = replicas["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator finds the container by this name
    assert container["command"][:3] == ["torchrun", "--nnodes=3", "--nproc_per_node=1"]
    assert "--node_rank=$(RANK)" in container["command"]
    assert container["command"][-5:] == ["rlaif", "stage", "train_rm", "--config", "s3://b/c.yaml"]
    assert pod["nodeSelector"] == {"gpu": "a100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["serviceAccountName"] == "rlaif-runner" and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"


def test_cpu_cluster_job_uses_config_nproc(cfg):
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(use_gpus=False), "ns")
    assert body["spec"]["trainer"]["numProcPerNode"] == cfg.ppo.nproc
    assert "nvidia.com/gpu" not in body["spec"]["trainer"]["resourcesPerNode"]["limits"]


class FakeCustomObjects:
    """Answers like the Kubernetes API: the job runs for `polls` reads, then ends in `final`."""

    def __init__(self, final: str, polls: int = 2, exists: dict | None = None):
        self.final, self.polls, self.created, self.deleted, self.job = final, polls, [], [], exists
        self.metadata = (exists or {}).get("metadata", {})

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        from kubernetes.client.exceptions import ApiException

        if self.job is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.created.append((group, version, namespace, plural, body))
        self.job, self.metadata = {"status": {}}, body["metadata"]

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **options):
        self.deleted.append(name)
        self.job = None

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        from kubernetes.client.exceptions import ApiException

        if self.job is None and self.deleted:
            raise ApiException(status=404, reason="Not Found")
        self.polls -= 1
        if self.polls > 0:
            return {"metadata": self.metadata, "status": {"conditions": [{"type": "Created", "status": "True"}]}}
        return {"metadata": self.metadata,
                "status": {"conditions": [{"type": "Created", "status": "True"},
                                          {"type": self.final, "status": "True", "message": f"job {self.final}"}]}}


@pytest.mark.parametrize("api,final,expected", [("trainjob", "Complete", "succeeded"), ("trainjob", "Failed", "failed"),
                                                 ("pytorchjob", "Succeeded", "succeeded"),
                                                 ("pytorchjob", "Failed", "failed")])
def test_wait_reads_the_terminal_condition(api, final, expected):
    client = FakeCustomObjects(final, polls=3)
    state, message = jobs.wait(client, api, "ns", "job", poll_s=0)
    assert (state, message) == (expected, f"job {final}")


def test_create_then_a_retry_reuses_the_running_job(cfg):
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns")
    client = FakeCustomObjects("Complete")
    jobs.create_or_reuse(client, "trainjob", body)
    assert client.created[0][:4] == ("trainer.kubeflow.org", "v1alpha1", "ns", "trainjobs")
    jobs.create_or_reuse(client, "trainjob", body)  # a retried pipeline step: 409, the job is still running
    assert len(client.created) == 1 and client.deleted == []


def test_job_names_differ_across_runs_and_stages_and_fit_kubernetes():
    """Run ids differing in case or punctuation, long ids differing past 50 characters (Airflow's run names), and one
    id under two storage roots shared a job name, and a retry then waited on, or deleted, the other run's job."""
    long_id = safe_run_id("asset_triggered__2026-11-29T00:40:12.345678+00:00_Kgn1OLYu")
    ids = ["Exp_1", "exp-1", "exp.1", "x_", "Exp_1.", long_id, long_id[:-1] + "v"]
    configs = [load_config("configs/tiny.yaml", [f"run_id={json.dumps(i)}", "storage.root=s3://team-a/r"]) for i in ids]
    configs.append(load_config("configs/tiny.yaml", ["run_id=Exp_1", "storage.root=s3://team-b/r"]))
    names = [jobs.job_name(STAGE_BY_NAME[stage], cfg) for cfg in configs for stage in ("generate", "train_rm", "ppo")]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 45 for name in names), names
    for cfg in configs:  # the label is a valid label value; the annotation keeps the run exactly
        metadata = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns")["metadata"]
        assert re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", metadata["labels"]["rlaif/run-id"])
        assert len(metadata["labels"]["rlaif/run-id"]) <= 63
        assert metadata["annotations"]["rlaif/run-dir"].endswith("/" + cfg.run_id)


def test_a_job_of_another_run_under_the_same_name_is_neither_waited_on_nor_deleted(cfg):
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns")
    others = {"metadata": {"annotations": {"rlaif/run-dir": "s3://b/elsewhere/Exp_1", "rlaif/stage": "ppo"}},
              "status": {}}
    for existing in (others, {"status": {}}):  # another run's; one rlaif did not make
        client = FakeCustomObjects("Failed", polls=1, exists=existing)
        with pytest.raises(UserError, match=f"TrainJob ns/{body['metadata']['name']} exists but is not this stage"):
            jobs.create_or_reuse(client, "trainjob", body)
        assert client.deleted == [] and client.created == []


@pytest.mark.parametrize("ended", ["Failed", "Complete"])
def test_an_ended_job_from_an_earlier_attempt_is_replaced(cfg, monkeypatch, ended):
    """Failed, or succeeded for another config or an output since damaged or rerun: its launcher found no valid
    output, so waiting on the old job would hand it back."""
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns", cache_checked="key")
    client = FakeCustomObjects(ended, polls=1, exists={"metadata": body["metadata"], "status": {}})
    jobs.create_or_reuse(client, "trainjob", body)
    assert client.deleted == [body["metadata"]["name"]] and len(client.created) == 1
    env = {e["name"]: e.get("value") for e in client.created[0][4]["spec"]["trainer"]["env"]}
    assert env["RLAIF_CACHE_CHECKED"] == "key"  # the pods run it: they do not take the old output as a hit
    assert env[LAUNCHED_CONFIG] == launched_config(cfg)  # and refuse a config.yaml rewritten since with other settings


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_stopped_launcher_deletes_its_job(cfg, monkeypatch, capsys, stop):
    """SIGTERM (a cancelled run) or Ctrl-C while waiting: the job goes, its pods with it; a finished wait leaves it."""
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns")
    client = FakeCustomObjects("Complete", polls=10)
    jobs.create_or_reuse(client, "trainjob", body)

    def stopped(seconds):
        raise stop

    monkeypatch.setattr(jobs.time, "sleep", stopped)
    name = body["metadata"]["name"]
    with pytest.raises(stop):
        jobs.wait_or_stop(client, "trainjob", "ns", name)
    assert client.deleted == [name] and client.job is None
    assert f"deleted trainjobs ns/{name}" in capsys.readouterr().out
    finished = FakeCustomObjects("Complete", polls=1, exists={"status": {}})
    assert jobs.wait_or_stop(finished, "trainjob", "ns", "j", poll_s=0)[0] == "succeeded" and finished.deleted == []


def test_a_run_in_a_pod_that_is_no_stage_pod_is_checked_as_this_machine_runs_it(monkeypatch, tmp_path):
    """`rlaif run` in a notebook server's pod runs every stage there: batch sizes its processes do not divide were
    let through (any pod counted as a stage pod, whose stage checks the world it gets) to fail after generate and
    label. A stage pod is one the pipeline made: it carries the cluster settings."""
    from rlaif.orchestration import launch, preflight

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.delenv("RLAIF_CLUSTER_JSON", raising=False)
    cfg = load_config("configs/tiny.yaml", ["ppo.nproc=2", "ppo.rollout_batch_size=6", "ppo.minibatch_size=3",
                                            "ppo.grad_accum_steps=1", f"storage.root=file://{tmp_path}"])
    with pytest.raises(UserError, match="ppo.minibatch_size=3 must be divisible by 2 processes"):
        launch.prepare(cfg)
    assert not preflight.in_stage_pod()
    monkeypatch.setenv("RLAIF_CLUSTER_JSON", "{}")
    assert preflight.in_stage_pod()  # its stage checks the processes it gets


def test_multinode_outside_a_cluster_is_refused_before_any_stage(cfg, monkeypatch, tmp_path):
    from rlaif.orchestration import launch

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = load_config("configs/tiny.yaml", ["ppo.nodes=2", f"storage.root=file://{tmp_path}"])
    with pytest.raises(UserError, match="ppo.nodes=2 needs a Kubernetes cluster"):
        launch.prepare(cfg)
    assert not (tmp_path / "tiny").exists()


class FlakyCustomObjects(FakeCustomObjects):
    """The API answers `failures` (status codes, or an OSError) before each good answer."""

    def __init__(self, failures, **kwargs):
        super().__init__("Complete", exists={"status": {}}, **kwargs)
        self.failures = list(failures)

    def get_namespaced_custom_object(self, *args):
        from kubernetes.client.exceptions import ApiException

        if self.failures:
            failure = self.failures.pop(0)
            raise failure if isinstance(failure, OSError) else ApiException(status=failure, reason="Bad")
        return super().get_namespaced_custom_object(*args)


@pytest.fixture
def no_sleep(monkeypatch):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)


def test_the_wait_rides_out_an_api_server_that_restarts(no_sleep):
    client = FlakyCustomObjects([503, ConnectionResetError("reset by peer"), 429], polls=2)
    assert jobs.wait(client, "trainjob", "ns", "j", poll_s=0) == ("succeeded", "job Complete")


def test_an_api_that_stays_down_ends_the_wait_in_one_line(no_sleep, monkeypatch):
    monkeypatch.setattr(jobs, "API_PATIENCE_S", 0.0)
    with pytest.raises(jobs.JobError, match=r"failed to read trainjobs ns/j for 0s \(last: 502 Bad\); a job already"):
        jobs.wait(FlakyCustomObjects([502] * 5), "trainjob", "ns", "j", poll_s=0)


def test_a_job_deleted_under_the_wait_or_not_readable_is_reported(no_sleep):
    client = FakeCustomObjects("Complete", polls=5)
    client.delete_namespaced_custom_object("g", "v", "ns", "pytorchjobs", "j")  # kubectl delete while the step waited
    state, message = jobs.wait(client, "pytorchjob", "ns", "j", poll_s=0)
    assert state == "failed" and "deleted while this step waited on it" in message
    with pytest.raises(UserError, match="service account may not read trainjobs in ns .403 Bad.: grant it get"):
        jobs.wait(FlakyCustomObjects([403]), "trainjob", "ns", "j", poll_s=0)


class FakePods:
    """CoreV1Api.list_namespaced_pod with _preload_content=False: the pods' JSON, or a refusal."""

    REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 400: "Bad Request"}

    def __init__(self, pods: list[dict] | None = None, status: int | None = None, body: bytes | None = None):
        self.pods, self.status, self.body, self.selectors = pods or [], status, body, []

    def list_namespaced_pod(self, namespace, label_selector, _preload_content):
        from types import SimpleNamespace

        from kubernetes.client.exceptions import ApiException

        self.selectors.append(label_selector)
        if self.status:
            raise ApiException(status=self.status, reason=self.REASONS[self.status])
        return SimpleNamespace(data=self.body or json.dumps({"items": self.pods}).encode())


def waiting_pod(reason: str, message: str) -> dict:
    return {"metadata": {"name": "rlaif-x-node-0-0"},
            "status": {"containerStatuses": [{"name": "node", "state": {"waiting": {"reason": reason,
                                                                                  "message": message}}}]}}


UNSCHEDULABLE = {"metadata": {"name": "x-master-0"},
                 "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}


@pytest.fixture
def clock(monkeypatch):
    """jobs' time: sleep() moves it on; no real waiting."""
    from types import SimpleNamespace

    now = [1000.0]

    def sleep(seconds):
        now[0] += seconds

    monkeypatch.setattr(jobs, "time", SimpleNamespace(time=lambda: now[0], sleep=sleep))
    return now


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                                    "CreateContainerConfigError"])
def test_pods_that_cannot_start_end_the_wait_after_their_grace(clock, reason):
    """The job itself stays 'running' for good when its image does not pull or a secret key is missing; a problem
    that lasts less than the grace (a registry hiccup) does not end it."""
    pods = FakePods([waiting_pod(reason, 'Back-off pulling image "ghcr.io/team/rlaif:0.1.O"')])
    state, message = jobs.wait(FakeCustomObjects("Complete", polls=100), "trainjob", "ns", "rlaif-x", poll_s=15,
                               pods=pods)
    assert state == "stuck" and message.startswith(f"pod rlaif-x-node-0-0 cannot start node for 300s: {reason}: ")
    assert 'ghcr.io/team/rlaif:0.1.O' in message and pods.selectors[0] == "jobset.sigs.k8s.io/jobset-name=rlaif-x"
    assert clock[0] - 1000 == jobs.START_GRACE_S  # polled every 15 s: ended at the first poll past the grace


def test_a_start_problem_that_clears_starts_its_grace_again(clock):
    bad = waiting_pod("ImagePullBackOff", "rate limited")
    pods = FakePods([bad])

    class Clears(FakeCustomObjects):  # the pull works for one poll at 240 s, then the registry throttles again
        def get_namespaced_custom_object(self, *args):
            pods.pods = [] if clock[0] - 1000 == 240 else [bad]
            return super().get_namespaced_custom_object(*args)

    state, message = jobs.wait(Clears("Complete", polls=100), "trainjob", "ns", "x", poll_s=15, pods=pods)
    assert state == "stuck" and clock[0] - 1000 == 255 + jobs.START_GRACE_S


def test_a_stuck_job_is_deleted_with_its_pods(no_sleep, monkeypatch, capsys):
    """Left behind, its pods kept what they had (GPUs of a partly scheduled job) and each retry of the step found it
    'running' and waited on it for another grace."""
    monkeypatch.setattr(jobs, "START_GRACE_S", 1e-6)
    client = FakeCustomObjects("Complete", polls=100)
    state, message = jobs.wait_or_stop(client, "trainjob", "ns", "x", poll_s=0,
                                       pods=FakePods([waiting_pod("ErrImagePull", "not found")]))
    assert state == "failed" and "cannot start node" in message and client.deleted == ["x"]
    assert "stuck: deleted trainjobs ns/x and its pods" in capsys.readouterr().out


def test_a_pod_no_node_takes_fails_the_wait_only_past_the_start_timeout(no_sleep):
    pods = FakePods([UNSCHEDULABLE])
    state, message = jobs.wait(FakeCustomObjects("Failed", polls=3), "pytorchjob", "ns", "x", poll_s=0, pods=pods,
                               start_timeout_s=1e-6)
    assert state == "stuck" and "pod x-master-0 found no node for 0s: 0/3 nodes are available: 3 Insuf" in message
    assert pods.selectors[0] == "training.kubeflow.org/job-name=x"
    for timeout in (0, 3600):  # 0: wait for good; an hour: a node pool may still be scaling up
        client = FakeCustomObjects("Succeeded", polls=3)
        assert jobs.wait(client, "pytorchjob", "ns", "x", poll_s=0, pods=FakePods([UNSCHEDULABLE]),
                         start_timeout_s=timeout) == ("succeeded", "job Succeeded")


@pytest.mark.parametrize("status", [403, 401, 404, 400, None])
def test_pods_that_cannot_be_listed_leave_the_wait_on_the_job(no_sleep, capsys, status):
    pods = FakePods(status=status, body=b"<html>proxy</html>" if status is None else None)
    client = FakeCustomObjects("Complete", polls=4)
    assert jobs.wait(client, "trainjob", "ns", "x", poll_s=0, pods=pods)[0] == "succeeded"
    out = capsys.readouterr().out
    reason = f"{status} {FakePods.REASONS[status]}" if status else "an answer that is not JSON"
    assert len(pods.selectors) == 1 and f"cannot list the pods of x ({reason}): pods that never start" in out
    assert ("service account needs list on pods" in out) == (status in (401, 403))


def test_multinode_without_a_service_account_token_is_one_line(cfg, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(UserError, match="ppo.nodes=4: cannot reach the Kubernetes API from this pod"):
        jobs.run_multinode(STAGE_BY_NAME["ppo"], cfg, "u", 4, "key")


def test_a_replaced_job_that_will_not_go_ends_in_one_line(clock, cfg):
    """The old job deleted (its pods first: Foreground) but still there past the patience: a finalizer, say."""
    body = jobs.job_manifest(STAGE_BY_NAME["ppo"], cfg, "u", 2, ClusterSpec(), "ns")

    class Lingers(FakeCustomObjects):
        def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **options):
            self.deleted.append((name, options))  # accepted, but the object stays

    client = Lingers("Failed", polls=1, exists={"metadata": body["metadata"], "status": {}})
    with pytest.raises(jobs.JobError, match="was deleted but is still there after 300s .* and retry"):
        jobs.create_or_reuse(client, "trainjob", body)
    assert client.deleted == [(body["metadata"]["name"], {"propagation_policy": "Foreground"})]
    assert client.created == []


def test_a_failed_wait_or_create_ends_as_a_failed_stage(cfg, monkeypatch):
    """An API that stays down while the step creates or watches its job: one line and the stage's failure, which
    the orchestrator retries (no traceback)."""
    from types import SimpleNamespace

    import kubernetes

    from rlaif.errors import StageFailed

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: FlakyCustomObjects([503] * 3))
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: SimpleNamespace())
    monkeypatch.setattr(jobs, "API_PATIENCE_S", 0.0)

    def down(*args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        raise ApiException(status=503, reason="Service Unavailable")

    monkeypatch.setattr(FlakyCustomObjects, "create_namespaced_custom_object", down)
    with pytest.raises(StageFailed) as failed:
        jobs.run_multinode(STAGE_BY_NAME["ppo"], cfg, "u", 4, "key")
    line = str(failed.value)
    assert line.startswith("stage 'ppo' failed: TrainJob ") and "the Kubernetes API failed to create trainjobs" in line
    assert "(last: 503 Service Unavailable)" in line
    assert line.endswith(f"(its pods' output: kubectl logs -n default -l rlaif/run-id={cfg.run_id},rlaif/stage=ppo)")
