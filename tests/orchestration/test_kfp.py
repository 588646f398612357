"""The Kubeflow pipeline: generated from graph.py, compiled copy fresh, resources and secrets wired, and the whole
pipeline executed by KFP itself through kfp.local on the tiny config."""
import contextlib
import http.server
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlaif.graph import STAGE_BY_NAME, STAGES
from rlaif.orchestration import image_files, kfp_pipeline
from rlaif.orchestration.cluster import ClusterSpec, SecretEnv, from_dict

REPO = Path(__file__).resolve().parents[2]
S3 = "s3://bucket/rlaif"  # the pods share only object storage: submit refuses a file:// root


def compiled(tmp_path, spec: ClusterSpec | None = None) -> dict:
    out = tmp_path / "p.yaml"
    from kfp import compiler

    compiler.Compiler().compile(kfp_pipeline.build_pipeline(spec), str(out))
    docs = list(yaml.safe_load_all(out.read_text()))
    return {"pipeline": docs[0], "platform": docs[1] if len(docs) > 1 else {}}


def test_checked_in_yaml_is_fresh(tmp_path):
    kfp_pipeline.compile_pipeline(str(tmp_path / "p.yaml"), None, str(tmp_path / "components"))
    stale = "stale: run `make pipeline` and commit pipelines/ and components/"
    assert (tmp_path / "p.yaml").read_text() == (REPO / "pipelines/rlaif_pipeline.yaml").read_text(), stale
    for stage in STAGES:
        fresh = (tmp_path / "components" / stage.name / "component.yaml").read_text()
        assert fresh == (REPO / "components" / stage.name / "component.yaml").read_text(), stale


def test_components_take_exactly_the_graph_inputs():
    assert set(kfp_pipeline.COMPONENTS) == set(STAGE_BY_NAME)
    for stage in STAGES:
        spec = kfp_pipeline.COMPONENTS[stage.name].component_spec
        artifacts_in = {n for n, i in spec.inputs.items() if i.type.startswith("system.")}
        assert artifacts_in == {f"{dep}_manifest" for dep in stage.inputs}, stage.name
        assert "manifest" in spec.outputs
        assert {"config", "overrides", "run_id", "storage_root", "default_run_id"} <= set(spec.inputs)


def test_pipeline_tasks_edges_resources_and_secrets(tmp_path):
    spec = ClusterSpec(gpu_node_selector={"nvidia.com/gpu.product": "H100"}, node_selector={"pool": "ml"},
                       env={"AWS_ENDPOINT_URL": "http://minio.minio:9000"})
    docs = compiled(tmp_path, spec)
    kfp_name = {s.name: s.name.replace("_", "-") for s in STAGES}  # KFP task names are DNS-style
    tasks = docs["pipeline"]["root"]["dag"]["tasks"]
    assert set(tasks) == set(kfp_name.values())
    executors = docs["pipeline"]["deploymentSpec"]["executors"]
    k8s = docs["platform"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for stage in STAGES:
        task = tasks[kfp_name[stage.name]]
        assert set(task.get("dependentTasks", [])) == {kfp_name[d] for d in stage.inputs}
        for dep in stage.inputs:
            src = task["inputs"]["artifacts"][f"{dep}_manifest"]["taskOutputArtifact"]
            assert src == {"outputArtifactKey": "manifest", "producerTask": kfp_name[dep]}
        assert task["retryPolicy"]["maxRetryCount"] == spec.retries
        assert task["cachingOptions"] == {} or not task["cachingOptions"].get("enableCache")
        container = executors[f"exec-{kfp_name[stage.name]}"]["container"]
        res = container["resources"]
        assert float(res["cpuRequest"]) == stage.resources.cpu
        assert container["image"] == spec.gpu_image  # every stage has a GPU on a GPU cluster
        assert res["accelerator"]["resourceType"] == "nvidia.com/gpu" and int(res["accelerator"]["resourceCount"]) == 1
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["AWS_ENDPOINT_URL"] == "http://minio.minio:9000"
        assert json.loads(env["RLAIF_CLUSTER_JSON"])["gpu_image"] == spec.gpu_image
        platform = k8s[f"exec-{kfp_name[stage.name]}"]
        secrets = {s["secretName"]: s for s in platform["secretAsEnv"]}
        assert {e["envVar"]: e["secretKey"] for e in secrets["rlaif-storage"]["keyToEnv"]} == {
            "AWS_ACCESS_KEY_ID": "access_key", "AWS_SECRET_ACCESS_KEY": "secret_key"}
        assert secrets["rlaif-judge"]["optional"] is True
        assert platform["nodeSelector"]["labels"] == {"pool": "ml", "nvidia.com/gpu.product": "H100"}
        assert platform["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert platform["emptyDirMounts"][0]["mountPath"] == "/dev/shm"


def test_a_streaming_config_starts_label_beside_generate(tmp_path):
    """label.streaming: still two tasks, but label neither waits for generate nor takes its artifact, and it is told to
    stream; the rest of the graph is unchanged."""
    config = tmp_path / "streaming.yaml"
    tiny = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    config.write_text(yaml.safe_dump({**tiny, "label": {**tiny["label"], "streaming": True}}))
    out = tmp_path / "p.yaml"
    kfp_pipeline.compile_pipeline(str(out), None, None, str(config))
    tasks = next(yaml.safe_load_all(out.read_text()))["root"]["dag"]["tasks"]
    assert "dependentTasks" not in tasks["label"] and "artifacts" not in tasks["label"]["inputs"]
    assert tasks["label"]["inputs"]["parameters"]["streaming"] == {"runtimeValue": {"constant": True}}
    assert tasks["train-rm"]["dependentTasks"] == ["label"] and set(tasks) == {"generate", "label", "train-rm", "ppo",
                                                                             "evaluate"}
    sequential = compiled(tmp_path)["pipeline"]["root"]["dag"]["tasks"]["label"]
    assert sequential["dependentTasks"] == ["generate"] and "streaming" not in sequential["inputs"]["parameters"]


def test_cpu_cluster_gets_cpu_image_and_no_gpus(tmp_path):
    docs = compiled(tmp_path, ClusterSpec(use_gpus=False))
    for name, executor in docs["pipeline"]["deploymentSpec"]["executors"].items():
        assert executor["container"]["image"] == ClusterSpec().image
        assert "accelerator" not in executor["container"]["resources"], name


def test_no_secret_value_reaches_the_compiled_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3CR3T-value-9f2c")
    monkeypatch.setenv("RLAIF_JUDGE_API_KEY", "S3CR3T-judge-77ab")
    text = yaml.safe_dump(compiled(tmp_path))
    assert "S3CR3T" not in text
    assert "S3CR3T" not in (REPO / "pipelines/rlaif_pipeline.yaml").read_text()


def test_cluster_settings_refuse_unknown_keys():
    with pytest.raises(ValueError, match="unknown cluster setting.*gpu_typo"):
        from_dict({"gpu_typo": "a100"})
    with pytest.raises(ValueError, match="multinode_api"):
        from_dict({"multinode_api": "mpijob"})
    spec = from_dict(yaml.safe_load((REPO / "configs/cluster.yaml").read_text()))
    assert spec.secrets[0] == SecretEnv(name="rlaif-storage", env={"AWS_ACCESS_KEY_ID": "access_key",
                                                                    "AWS_SECRET_ACCESS_KEY": "secret_key"})


def test_submit_sends_the_config_inline_and_validates_it_first(tmp_path):
    class FakeClient:
        calls = []

        def create_run_from_pipeline_func(self, func, experiment_name, arguments):
            self.calls.append((func, experiment_name, arguments))
            return type("Run", (), {"run_id": "run-123"})()

    client = FakeClient()
    run = kfp_pipeline.submit("http://kfp.invalid", "configs/tiny.yaml", ["ppo.iterations=3"], "exp1", "s3://bucket-b/r",
                              None, "rlaif-dev", client=client)
    assert run == "run-123"
    _, experiment, args = client.calls[0]
    assert experiment == "rlaif-dev"
    assert args["config"] == (REPO / "configs/tiny.yaml").read_text() and args["overrides"] == ["ppo.iterations=3"]
    assert args["run_id"] == "exp1" and args["storage_root"] == "s3://bucket-b/r"
    from rlaif.errors import UserError

    with pytest.raises(UserError, match="ppo.iterationz"):
        kfp_pipeline.submit("http://kfp.invalid", "configs/tiny.yaml", ["ppo.iterationz=3"], "", S3, None, "x",
                            client=client)
    with pytest.raises(UserError, match="s3:/bucket"):  # refused as `rlaif run` refuses it
        kfp_pipeline.submit("http://kfp.invalid", "configs/tiny.yaml", [], "", "s3:/bucket", None, "x", client=client)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(UserError, match=f"config file {empty} holds no settings"):  # not the demo's defaults
        kfp_pipeline.submit("http://kfp.invalid", str(empty), [], "", S3, None, "x", client=client)
    assert len(client.calls) == 1
    one_line = tmp_path / "one.yaml"
    one_line.write_text("seed: 3")  # no line end: still sent as the YAML itself, not read as a path in the pods
    kfp_pipeline.submit("http://kfp.invalid", str(one_line), [], "", S3, None, "x", client=client)
    assert client.calls[-1][2]["config"] == "seed: 3\n"
    kfp_pipeline.submit("http://kfp.invalid", f"file://{one_line}", [], "", S3, None, "x", client=client)
    assert client.calls[-1][2]["config"] == "seed: 3\n"  # a file:// URL names this machine's file too

    class LoginPage(FakeClient):  # an auth proxy's 200: kfp returns a run without an id
        def create_run_from_pipeline_func(self, func, experiment_name, arguments):
            return type("Run", (), {"run_id": None})()

    with pytest.raises(UserError, match="answered without a run id"):
        kfp_pipeline.submit("http://kfp.invalid", "configs/tiny.yaml", [], "", S3, None, "x", client=LoginPage())


def test_submit_refuses_a_run_only_the_cluster_would_fail(tmp_path, capsys):
    """Batch sizes that do not split over the processes each stage gets there (its pod's GPUs times its nodes, or
    its config's nproc on a CPU cluster): refused before submitting, not in the third pod an hour in. A file://
    root (each stage's pod writes its own disk unless every pod mounts that path) and input files only this machine
    has: submitted with a warning."""
    from rlaif.errors import UserError

    class Recorder:
        runs = []

        def create_run_from_pipeline_func(self, func, experiment_name, arguments):
            self.runs.append(arguments)
            return type("Run", (), {"run_id": "run-1"})()

    def submit(overrides, root=S3, cluster=None):
        kfp_pipeline.submit("http://kfp.invalid", "configs/tiny.yaml", overrides, "", root, cluster, "x",
                            client=Recorder())

    for root in ("", f"file://{tmp_path}/runs"):  # tiny.yaml's own root is file://./runs
        submit([], root)
        assert "is a directory each stage's pod has to itself unless every pod mounts it" in capsys.readouterr().out
    submit([])
    assert "warning" not in capsys.readouterr().out
    mine = tmp_path / "mine.jsonl"  # an input file only this machine has (test_input_files_only_this_machine_has)
    mine.write_text('{"prompt": "hi"}\n')
    submit([f"data.prompts={mine}"])
    assert f"warning: input files only this machine has: data.prompts={mine} (an absolute path" in \
        capsys.readouterr().out
    Recorder.runs.clear()
    eight_gpus, three_gpus = tmp_path / "eight.yaml", tmp_path / "three.yaml"
    eight_gpus.write_text("stages: {ppo: {gpus: 8}}\n")
    three_gpus.write_text("stages: {train_rm: {gpus: 3}}\n")
    with pytest.raises(UserError, match="ppo.rollout_batch_size=40 must be divisible by 16 processes"):
        submit(["ppo.nodes=2", "ppo.rollout_batch_size=40", "ppo.minibatch_size=8"], cluster=str(eight_gpus))
    submit(["ppo.nodes=2", "ppo.rollout_batch_size=32", "ppo.minibatch_size=16"], cluster=str(eight_gpus))
    assert len(Recorder.runs) == 1  # 32 and 16 split over 16 processes; nothing above was submitted
    with pytest.raises(UserError, match=r"train_rm.batch_size=16 must be divisible by processes x grad_accum_steps "
                                        r"\(3 x 1\)"):
        submit(["train_rm.batch_size=16", "train_rm.grad_accum_steps=1"], cluster=str(three_gpus))
    cpu_cluster = tmp_path / "cpu.yaml"
    cpu_cluster.write_text("use_gpus: false\n")
    with pytest.raises(UserError, match="must be divisible by 3 processes"):
        submit(["ppo.nproc=3", "ppo.rollout_batch_size=8"], cluster=str(cpu_cluster))
    # vLLM in a generate pod without a GPU: the run's first pod failed; compiled for that config, refused too
    no_gpu_for_generate = tmp_path / "no-gpu-generate.yaml"
    no_gpu_for_generate.write_text("stages: {generate: {gpus: 0}}\n")
    vllm = tmp_path / "vllm.yaml"
    settings = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    vllm.write_text(yaml.safe_dump({**settings, "generate": {**settings["generate"], "backend": "vllm"}}))
    for cluster in (cpu_cluster, no_gpu_for_generate):
        with pytest.raises(UserError, match="^generate.backend=vllm runs vLLM in generate's pod, which gets no GPU"):
            submit(["generate.backend=vllm"], cluster=str(cluster))
        with pytest.raises(UserError, match="^generate.backend=vllm runs vLLM in generate's pod, which gets no GPU"):
            kfp_pipeline.compile_pipeline(str(tmp_path / "p.yaml"), str(cluster), None, str(vllm))
    assert not (tmp_path / "p.yaml").exists()
    assert kfp_pipeline.compile_pipeline(str(tmp_path / "p.yaml"), None, None, str(vllm))  # a GPU per generate pod


def test_input_files_only_this_machine_has(tmp_path, monkeypatch):
    """The pods read relative paths from the image's working directory, which carries the repository's configs/ and
    data/ and nothing else of this machine's; absolute paths from their own disks. Globs, ~ and file:// as the stages
    read them; URLs, hub ids and paths this machine lacks are not this machine's to judge."""
    from rlaif.orchestration.launch import load_config_source

    only_here = image_files.only_on_this_machine
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds" / "part").mkdir(parents=True)
    (tmp_path / "ds" / "part" / "a.parquet").write_text("")
    (tmp_path / "p.jsonl").write_text("{}\n")
    for shipped in ("data/prompts.jsonl", "./data/constitution.yaml", "data/../data/prompts.jsonl", "configs/*.yaml",
                    "s3://bucket/p.jsonl", "hf://datasets/org/name", "org/model", "builtin:minilm", "absent.jsonl",
                    "/opt/rlaif/data/prompts.jsonl"):
        assert only_here(shipped) is None, shipped
    for absolute in (str(tmp_path / "p.jsonl"), f"file://{tmp_path}/p.jsonl", "~/p.jsonl", "file://~/p.jsonl",
                     f"{tmp_path}/ds/**/*.parquet", str(tmp_path / "ds")):
        assert only_here(absolute).startswith("an absolute path"), absolute
    assert only_here("README.md").startswith("outside configs and data") and only_here(".").startswith("outside")
    assert only_here(f"../{REPO.name}/data/prompts.jsonl").startswith("outside configs and data")
    # One's own data/prompts.jsonl, submitted from elsewhere: the pods would read the image's demo prompts instead.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("{}\n")
    assert only_here("data/prompts.jsonl") == (f"read here from {tmp_path.resolve()}: the pods read "
                                                "/opt/rlaif/data/prompts.jsonl in the image instead")
    cfg = load_config_source(str(REPO / "configs/tiny.yaml"), ["label.constitution=~/p.jsonl"], "", S3)
    (warning,) = kfp_pipeline.check_runs_on_cluster(cfg, ClusterSpec())
    assert warning.startswith("warning: input files only this machine has: data.prompts=data/prompts.jsonl (read "
                              "here from ") and "; label.constitution=~/p.jsonl (an absolute path" in warning


def test_input_files_added_or_changed_in_the_checkout(tmp_path, monkeypatch):
    """Submitted from the repository, its configs/ and data/ are the image's only as committed: a prompts file added
    there, or one edited, is in the image only if it was built from this working tree."""
    import subprocess

    checkout = tmp_path / "checkout"
    (checkout / "configs").mkdir(parents=True)
    (checkout / "data").mkdir()
    (checkout / "data" / "prompts.jsonl").write_text("{}\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "data"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    monkeypatch.setattr(image_files, "REPO", checkout)
    monkeypatch.chdir(checkout)
    assert image_files.only_on_this_machine("data/prompts.jsonl") is None
    (checkout / "data" / "mine.jsonl").write_text("{}\n")
    (checkout / "data" / "prompts.jsonl").write_text('{"prompt": "edited"}\n')
    for added_or_changed in ("data/mine.jsonl", "data/prompts.jsonl"):
        assert image_files.only_on_this_machine(added_or_changed) == (
            "not as committed here: the image has it only if it was built from this working tree")


@contextlib.contextmanager
def silent_server(answer_healthz: bool):
    """A local KFP endpoint that accepts connections and never answers (with `answer_healthz`: only its healthz
    answers, as a server that hangs after the first request); yields its URL."""
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if answer_healthz and self.path.endswith(kfp_pipeline.HEALTHZ):
                body = b'{"multi_user": false}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            stop.wait()  # never answers while the test runs

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_submit_to_an_endpoint_that_never_answers_ends_in_time():
    from rlaif.errors import UserError

    with silent_server(answer_healthz=False) as endpoint:
        started = time.monotonic()
        with pytest.raises(UserError, match=rf"KFP endpoint {endpoint} did not answer within 0.5s: check --endpoint"):
            kfp_pipeline.submit(endpoint, "configs/tiny.yaml", [], "", S3, None, "x", timeout_s=0.5)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("status, body, needle", [
    (404, b"<html>File not found</html>", "is not a KFP 2 API server (/apis/v2beta1/healthz answered 404)"),
    (200, b"<html><form>Log in</form></html>", "healthz answered 200 with a web page"),
    (503, b"upstream connect error", "answered 503 at /apis/v2beta1/healthz: the KFP API server is not ready"),
])
def test_submit_to_a_server_that_is_not_kfp_is_one_line_at_once(status, body, needle, capfd):
    """A web server, a login page or a proxy before its upstream: kfp.Client asked healthz 5 times, 5 s apart, logging
    a traceback for each, then blamed a timeout."""
    from rlaif.errors import UserError

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        with pytest.raises(UserError, match=re.escape(needle)):
            kfp_pipeline.submit(f"http://127.0.0.1:{server.server_address[1]}", "configs/tiny.yaml", [], "", S3, None,
                                "x", timeout_s=5)
        assert time.monotonic() - started < 5 and "Traceback" not in "".join(capfd.readouterr())
    finally:
        server.shutdown()
        server.server_close()


def test_every_kfp_client_request_is_bounded(monkeypatch, tmp_path):
    """Past a healthz that answers, the client's own requests (the experiment, the run) end in time too."""
    from rlaif.errors import UserError

    monkeypatch.setenv("HOME", str(tmp_path))  # no kfp context file: the client asks healthz in its constructor
    with silent_server(answer_healthz=True) as endpoint:
        started = time.monotonic()
        with pytest.raises(UserError, match=rf"KFP endpoint {endpoint} did not answer within 0.5s while submitting"):
            kfp_pipeline.submit(endpoint, "configs/tiny.yaml", [], "", S3, None, "x", timeout_s=0.5)
    assert time.monotonic() - started < 20  # urllib3 retries a GET 3 times


@pytest.mark.slow
def test_pipeline_runs_end_to_end_in_kfp_local(tmp_path, monkeypatch):
    from kfp import local

    # Components run `python3 -m kfp.dsl.executor_main` in a subprocess: this environment's python must come first.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(REPO)  # relative paths in the config resolve here, as in the image's working directory
    root = tmp_path / "kfp-root"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    pipeline = kfp_pipeline.build_pipeline()
    storage_root = f"file://{tmp_path}/runs"
    pipeline(config=(REPO / "configs/tiny.yaml").read_text(), overrides=["evaluate.n_prompts=8"], run_id="",
             storage_root=storage_root)

    (job,) = [p for p in root.iterdir() if p.is_dir()]
    run_dir = tmp_path / "runs" / job.name  # empty run_id: the KFP job's name
    for stage in STAGES:
        stored = json.loads((run_dir / stage.name / "manifest.json").read_text())
        passed = json.loads((job / stage.name.replace("_", "-") / "manifest").read_text())  # KFP task names
        assert passed["digest"] == stored["digest"]
    metrics = json.loads((job / "evaluate" / "executor_output.json").read_text())
    logged = metrics["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    summary = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    assert logged["win_rate"] == pytest.approx(summary["win_rate"]) and logged["n_prompts"] == 8
    assert logged["kl_to_reference"] == pytest.approx(summary["kl_to_reference"])
    assert (job / "evaluate" / "report").read_text().startswith("<!doctype html>")
    assert (job / "evaluate" / "report_markdown").read_text().startswith("#")

    # A retried or repeated run on the same run_id: every stage is a cache hit and the outputs are unchanged.
    before = {s.name: (run_dir / s.name / "manifest.json").read_text() for s in STAGES}
    pipeline(config="configs/tiny.yaml", overrides=["evaluate.n_prompts=8"], run_id=job.name, storage_root=storage_root)
    assert before == {s.name: (run_dir / s.name / "manifest.json").read_text() for s in STAGES}


def test_a_pipeline_compiled_for_a_config_runs_that_config_by_default(tmp_path):
    """Its pods are sized for the config (rules judge: label on the CPU image): by default it must run that config,
    not the demo's, whose embedding judge those pods were not sized for."""
    config = tmp_path / "rules.yaml"
    from rlaif.orchestration.launch import load_config_source

    config.write_text("label:\n  judge: rules\n  constitution: ''\n")
    out = kfp_pipeline.compile_pipeline(str(tmp_path / "p.yaml"), config=str(config))
    spec = next(yaml.safe_load_all(Path(out).read_text()))
    default = spec["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"]
    assert "\n" not in default and load_config_source(default).label.judge == "rules"
    plain = next(yaml.safe_load_all(Path(kfp_pipeline.compile_pipeline(str(tmp_path / "q.yaml"))).read_text()))
    assert plain["root"]["inputDefinitions"]["parameters"]["config"]["defaultValue"] == "configs/demo.yaml"
