"""WebDataset shard reading: rlaif's reader (checksum and count verified per shard) from local disk and from S3
(moto_server on loopback, a real HTTP S3 endpoint), against plain webdataset on the same URLs and a raw read of the
same bytes (`cat` locally, whole-object GETs on S3). MB/s and samples/s, medians over --trials.

    .venv/bin/python bench/bench_shards.py [--shards 16] [--samples 512] [--trials 3] [--append]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import webdataset as wds

from rlaif.io import manifest, shards, storage

sys.path.insert(0, str(Path(__file__).parent))
from common import publish, timed  # noqa: E402


def write_stage(url: str, n_shards: int, per_shard: int) -> dict:
    rng = random.Random(0)
    words = ["river", "answer", "kind", "the", "sea", "because", "light", "question", "model", "policy"]
    with shards.ShardWriter(url, per_shard) as writer:
        for i in range(n_shards * per_shard):
            text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
            writer.write({"__key__": f"s{i:08d}", "prompt.txt": text(30), "response_a.txt": text(150),
                          "response_b.txt": text(150), "label.json": {"p_a": rng.random()}})
    return manifest.write(url, stage="bench", run_id="bench", config_hash="bench", inputs={}, shards=writer.shards)


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    sys.exit("moto_server did not start")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--samples", type=int, default=512, help="samples per shard")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--append", action="store_true")
    a = p.parse_args()
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    work = Path(tempfile.mkdtemp(prefix="rlaif-bench-shards-"))
    moto, endpoint = start_moto()
    try:
        storage.configure(endpoint)
        local_url = f"file://{work}/stage"
        m = write_stage(local_url, a.shards, a.samples)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        s3_url = "s3://bench/stage"
        for shard in m["shards"]:
            storage.upload_file(work / "stage" / shard["url"], storage.join(s3_url, shard["url"]))
        n_samples, n_bytes = m["num_samples"], sum(s["bytes"] for s in m["shards"])
        files = [str(work / "stage" / s["url"]) for s in m["shards"]]

        def rlaif_read(url):
            assert len(shards.read_all(url, m)) == n_samples

        def plain_wds(url):
            assert sum(1 for _ in wds.WebDataset([storage.join(url, s["url"]) for s in m["shards"]],
                                                 shardshuffle=False)) == n_samples

        def raw_s3():
            fs = storage.filesystem(s3_url)
            for s in m["shards"]:
                fs.cat_file(f"bench/stage/{s['url']}")

        cases = {
            "local disk: rlaif reader (sha256 + count checked)": lambda: rlaif_read(local_url),
            "local disk: plain webdataset": lambda: plain_wds(local_url),
            "local disk: raw `cat` of the same files":
                lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True),
            "S3 (moto_server, loopback): rlaif reader (sha256 + count checked)": lambda: rlaif_read(s3_url),
            "S3 (moto_server, loopback): plain webdataset (s3fs handler)": lambda: plain_wds(s3_url),
            "S3 (moto_server, loopback): raw whole-object GETs": raw_s3,
        }
        results = {}
        for name, fn in cases.items():
            fn()  # warm-up: page cache, connections
            seconds = timed(fn, a.trials)
            results[name] = (n_bytes / seconds / 2**20, n_samples / seconds)
            print(f"{name}: {results[name][0]:,.1f} MB/s, {results[name][1]:,.0f} samples/s", flush=True)
    finally:
        moto.kill()
        shutil.rmtree(work, ignore_errors=True)
    table = (f"| reader ({a.shards} shards x {a.samples} samples, {n_bytes / 2**20:.1f} MiB; {a.trials} trials) | "
             "MB/s | samples/s |\n"
             "|---|---|---|\n" + "".join(f"| {k} | {mb:,.1f} | {sps:,.0f} |\n" for k, (mb, sps) in results.items()))
    publish("WebDataset shard reading, local disk and S3", table, a.append)


if __name__ == "__main__":
    main()
