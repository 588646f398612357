"""The model services: one replica answering as the in-process judge does, bit for bit; and on Ray Serve, end to end:
the tiny policy and the tiny judge, two replicas each on a Ray cluster on loopback; generate and label run through
them while one replica of each is killed; the pairs and labels are the ones a run with the models in-process writes
(same manifest digests), none lost, none twice."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from rlaif.config import load_config
from rlaif.io import manifest, shards
from rlaif.stages.common import stage_url

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def rlaif(*args, **kw):
    return subprocess.run([sys.executable, "-m", "rlaif", *args], cwd=REPO, capture_output=True, text=True, **kw)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config(tmp_path_factory, judge_model_dir):
    tmp = tmp_path_factory.mktemp("served")
    raw = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    raw["storage"] = {"root": f"file://{tmp}/runs"}
    raw["generate"].update(max_prompts=24, batch_size=8, shard_size=6)
    raw["label"] = {"judge": "hf", "hf": {"model": str(judge_model_dir), "max_length": 256}, "batch_size": 4,
                    "shard_size": 5}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head on loopback for this module's services; stopped (with every process it started) at the end."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    # Ray's session files (and the replicas' logs, which a failure shows) in a directory of this run's own; short,
    # since Ray's Unix socket paths live under it (at most 107 bytes)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    started = subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                              "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats",
                              f"--temp-dir={temp_dir}"],
                             env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr[-2000:]
    yield RayCluster(f"127.0.0.1:{port}", temp_dir, free_port())
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    serve_port: int  # Serve's HTTP port: the first service on the cluster sets it, every later one must give it

    def diagnosis(self, servers) -> str:
        """What the `rlaif serve` drivers printed and the tail of Ray Serve's own logs (controller, proxy, replicas):
        why a service did not come up, in the failure message rather than on a machine that is gone."""
        parts = [f"--- {s.log.name} (exit {s.poll()}):\n{s.log.read_text()[-3000:]}" for s in servers]
        for log in sorted(self.temp_dir.glob("session_*/logs/serve/*.log"))[-8:]:
            parts.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


def replica_pids(base_url: str, want: int, cluster: RayCluster, servers, timeout_s: float = 300) -> set[int]:
    """The process ids of the replicas answering at base_url, once `want` distinct ones have answered."""
    seen, deadline = set(), time.time() + timeout_s
    while time.time() < deadline:
        if any(s.poll() is not None for s in servers):
            raise AssertionError(f"a service stopped before {base_url} answered\n{cluster.diagnosis(servers)}")
        try:
            with urllib.request.urlopen(base_url + "/models", timeout=10) as resp:
                seen.add(int(resp.headers["x-rlaif-replica"]))
        except OSError:
            time.sleep(0.5)
        if len(seen) >= want:
            return seen
    raise AssertionError(f"{base_url} did not answer from {want} replicas within {timeout_s}s (saw {seen})\n"
                         f"{cluster.diagnosis(servers)}")


def serve(config, cluster: RayCluster, model, prefix, port, log_dir: Path):
    log = log_dir / f"serve-{model}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlaif", "serve", "--config", str(config), "--address",
                                 cluster.address, "--set", f"serve.model={model}", "--set", "serve.replicas=2",
                                 "--set", f"serve.route_prefix={prefix}", "--set", f"serve.port={port}", "--set",
                                 "serve.cpus_per_replica=1"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def kill_one_replica_when(path_glob: Path, pids: set[int], proc) -> int:
    """SIGKILL one replica once the stage has written its first shard (it is mid-run then); the killed pid."""
    while not list(path_glob.parent.glob(path_glob.name)):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    return victim


def labels_of(cfg, stage):
    m = manifest.read(stage_url(cfg, stage))
    keys = [s["__key__"] for s in shards.read_samples(stage_url(cfg, stage), m, 0, 1, 0, 1)]
    return m, keys


@pytest.mark.slow
def test_generate_and_label_through_ray_serve_with_a_replica_killed(config, ray_cluster, tmp_path):
    for stage in ("generate", "label"):  # the reference: both models in-process
        done = rlaif("stage", stage, "--config", str(config), "--set", "run_id=local", timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    port = ray_cluster.serve_port
    base = f"http://127.0.0.1:{port}"
    servers = [serve(config, ray_cluster, model, f"/{model}", port, tmp_path) for model in ("policy", "judge")]
    try:
        pids = {model: replica_pids(f"{base}/{model}/v1", 2, ray_cluster, servers) for model in ("policy", "judge")}
        served = ["--set", "run_id=served", "--set", "generate.backend=endpoint",
                  "--set", f"generate.endpoint.base_url={base}/policy/v1", "--set", "generate.endpoint.backoff_s=0.2",
                  "--set", f"label.hf.endpoint.base_url={base}/judge/v1", "--set", "label.hf.endpoint.backoff_s=0.2"]
        cfg = load_config(str(config), ["run_id=served"])
        killed = {}
        for stage, model in (("generate", "policy"), ("label", "judge")):
            proc = subprocess.Popen([sys.executable, "-m", "rlaif", "stage", stage, "--config", str(config), *served],
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            killed[model] = kill_one_replica_when(Path(stage_url(cfg, stage).removeprefix("file://")) / "shard-*.tar",
                                                  pids[model], proc)
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-3000:]
        # the killed replicas were replaced: a new process answers beside the survivor
        for model in ("policy", "judge"):
            assert replica_pids(f"{base}/{model}/v1", 2, ray_cluster, servers) - pids[model], \
                f"{model}: no replacement replica answered"
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
        for server in servers:
            server.wait(timeout=120)

    local = load_config(str(config), ["run_id=local"])
    for stage in ("generate", "label"):
        ours, ours_keys = labels_of(cfg, stage)
        theirs, their_keys = labels_of(local, stage)
        assert len(ours_keys) == len(set(ours_keys)) == ours["num_samples"]  # no pair twice
        assert sorted(ours_keys) == sorted(their_keys)  # no pair lost
        assert ours["digest"] == theirs["digest"], f"{stage}: the served run wrote other {stage} data"
    summary = manifest.read(stage_url(cfg, "generate"))["summary"]
    label_summary = manifest.read(stage_url(cfg, "label"))["summary"]
    assert summary["endpoint_requests"] >= 2 * 24 and label_summary["endpoint"]["requests"] >= 2 * len(their_keys)
    print(json.dumps({"killed": killed, "generate_retries": summary["endpoint_retries"],
                      "label_retries": label_summary["endpoint"]["retries"]}))


@pytest.mark.slow
def test_a_replica_that_cannot_start_is_one_line_and_leaves_no_service(config, ray_cluster, tmp_path):
    """The replica's own error (here a missing file its model needs), not Serve's 'Deploying application failed'
    traceback; the failed application is removed from the shared cluster, so a fixed service can take its name. Then
    a service on a port other than the one Serve listens on is refused."""
    port = ray_cluster.serve_port
    failed = rlaif("serve", "--config", str(config), "--address", ray_cluster.address, "--set", f"serve.port={port}",
                   "--set", f"policy.tiny.demonstrations={tmp_path}/gone.jsonl", "--set", "serve.route_prefix=/gone",
                   "--set", "serve.name=rlaif-gone", timeout=300)
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines()[-1].startswith(
        f"error: the policy service did not start: demonstrations file not found: {tmp_path}/gone.jsonl"), \
        failed.stderr[-3000:]
    status = (f"import ray; from ray import serve; ray.init(address='{ray_cluster.address}', log_to_driver=False); "
              "print(sorted(serve.status().applications))")
    listed = subprocess.run([sys.executable, "-c", status], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "rlaif-gone" not in listed.stdout, listed.stdout + listed.stderr[-2000:]

    # Serve runs on the cluster now, on serve_port: a service given another port was announced there, where nothing
    # listened (Serve keeps the port it started with)
    elsewhere = free_port()
    refused = rlaif("serve", "--config", str(config), "--address", ray_cluster.address, "--set",
                    f"serve.port={elsewhere}", "--set", "serve.route_prefix=/elsewhere", timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: serve.port={elsewhere}, but the Ray Serve already running on this cluster listens on port "
        f"{port} (Serve keeps the HTTP options it started with): set serve.port={port} and a serve.route_prefix of "
        "this service's own"), refused.stderr[-3000:]


def test_plain_service_answers_and_scores_like_the_in_process_judge(judge_model_dir):
    from fastapi.testclient import TestClient

    from rlaif.errors import UserError
    from rlaif.judges.hf import HFJudge, answer_logprobs, answer_probability
    from rlaif.serving.api import plain_app
    from rlaif.serving.engine import make_engine

    cfg = load_config("configs/tiny.yaml", ["label.judge=hf", f"label.hf.model={judge_model_dir}",
                                            "serve.model=judge"])
    engine = make_engine(cfg, "judge")
    client = TestClient(plain_app(engine, "rlaif-judge"))
    info = client.get("/v1/models").json()["data"][0]["rlaif"]
    assert info["engine"] == "transformers" and info["role"] == "judge"
    judge = HFJudge(cfg.label, 4)
    texts = ["Request: q1\nResponse 1: a\nResponse 2: b\nPreferred response:", "Request: a longer question 2\n"
             "Response 1: x\nResponse 2: y\nPreferred response:"]
    enc = judge._encode(texts)
    # Top-1 only: at most one answer is the likeliest token. The answers' own log-probs come back whatever their rank
    # (a floor from the top 20 gave 0.5 served where the in-process judge said 0.57, under one cache key).
    bodies = [{"prompt": ids[mask.bool()].tolist(), "max_tokens": 1, "temperature": 0, "logprobs": 1,
               "logprob_token_ids": judge.answer_ids, "pad_to_tokens": enc["input_ids"].shape[1]}
              for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    answers = [client.post("/v1/completions", json=b).json()["choices"][0] for b in bodies]
    served = answer_probability(torch.tensor([answer_logprobs(a, judge.answer_ids) for a in answers]))
    assert torch.equal(served, judge._p_first(texts))  # bit for bit
    assert all(len(a["logprobs"]["top_token_ids"][0]) <= 3 for a in answers)
    other = next(t for t in range(100) if t not in judge.answer_ids)  # a service that ignores the extension
    with pytest.raises(UserError, match="did not return the answers' own log-probs"):
        answer_logprobs({"logprobs": {"top_token_ids": [[[judge.answer_ids[0], -0.1], [other, -2.0]]]}},
                        judge.answer_ids)
    for extra, problem in (({"logprobs": None}, "logprob_token_ids needs logprobs"),
                           ({"logprob_token_ids": [10**9]}, "outside the model's vocabulary")):
        refused = client.post("/v1/completions", json={**bodies[0], **extra})
        assert refused.status_code == 400 and problem in refused.json()["error"]["message"]
    refused = client.post("/v1/completions", json={"prompt": "x", "n": 3})
    assert refused.status_code == 400 and "n" in refused.json()["error"]["message"]
    for raw, problem in ((b"{not json", "not JSON"), (b"[1, 2]", "not a JSON object"), (b"\xff", "not JSON"),
                         (b'{"prompt": "x", "max_tokens": "4"}', "max_tokens"),  # OpenAI's error format, not 422
                         # a 500 with a traceback before: nesting past the recursion limit, an integer past Python's
                         # 4,300 digits, a lone surrogate in a stop string
                         (b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not JSON"),
                         (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "not JSON"),
                         (b'{"prompt": "x", "stop": "\\ud800"}', "stop holds a lone surrogate"),
                         (b'{"prompt": "x", "max_tokens": 2, "max_tokens": 9}', "gives the key 'max_tokens' twice"),
                         (b'{"prompt": "x", "temperature": NaN}', "finite number"),
                         # one request held the replica for a minute (a 20 MB prompt tokenized, 60k stop strings)
                         (b'{"prompt": "' + b"x" * (17 << 20) + b'"}', "is 17.0 MiB, more than the 16 MiB"),
                         (json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(300)]}).encode(),
                          "stop holds 300 strings, more than the 256")):
        refused = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert refused.status_code == 400 and problem in refused.json()["error"]["message"], refused.text
    # temperatures too small to divide logits by are served greedily, as vLLM serves them (NaN before)
    texts = [client.post("/v1/completions", json={"prompt": "q1", "max_tokens": 4, "temperature": t, "seed": s}
                         ).json()["choices"][0]["text"] for t, s in ((1e-45, 1), (0, 2))]
    assert texts[0] == texts[1]
    # copies of a prompt in one request without a seed are independent samples (they all shared one random seed);
    # with a seed, each copy is that seed's sample, as a seeded vLLM request is
    for seed, distinct in ((None, lambda n: n > 1), (7, lambda n: n == 1)):
        body = {"prompt": ["q1"] * 8, "max_tokens": 6, "temperature": 1.0} | ({"seed": seed} if seed else {})
        choices = client.post("/v1/completions", json=body).json()["choices"]
        assert distinct(len({c["text"] for c in choices})), (seed, choices)
    answer = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8]], "max_tokens": 3, "model": "rlaif-judge"})
    usage = answer.json()["usage"]  # what OpenAI clients read (completion_tokens alone before)
    assert usage["prompt_tokens"] == 4 and usage["total_tokens"] == 4 + usage["completion_tokens"], usage
    # another model's name is refused as OpenAI and vLLM refuse it (an openai judge aimed at a policy service by
    # mistake got the policy's samples)
    refused = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text
    assert "serves 'rlaif-judge'" in refused.json()["error"]["message"]
    # one request is one batch: a cache past serve.max_request_cache_gib is refused (it took the replica out of memory)
    small = make_engine(load_config("configs/tiny.yaml", ["label.judge=hf", f"label.hf.model={judge_model_dir}",
                                                         "serve.model=judge", "serve.max_request_cache_gib=0.0001"]),
                        "judge")
    fits = int(0.0001 * 2**30 / (9 * small.bytes_per_token))  # prompts of one token, plus 8 new ones each
    budgeted = TestClient(plain_app(small, "rlaif-judge"))
    assert budgeted.post("/v1/completions", json={"prompt": [[5]] * fits, "max_tokens": 8}).status_code == 200
    huge = budgeted.post("/v1/completions", json={"prompt": [[5]] * (fits + 1), "max_tokens": 8})
    assert huge.status_code == 400 and "serve.max_request_cache_gib" in huge.json()["error"]["message"], huge.text
    # --no-ray serves under serve.route_prefix, as Ray Serve does (it served /v1 and printed /judge/v1 before)
    prefixed = TestClient(plain_app(engine, "rlaif-judge", "/judge"))
    assert prefixed.get("/judge/v1/models").status_code == 200 and prefixed.get("/v1/models").status_code == 404
