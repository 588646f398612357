"""Stage 1 on the tiny policy: per-sample seeds make the output independent of batching, bucketing and splitting
(3 parts == 1 run == 2 torchrun ranks, and any pair regenerates alone), identical pairs are resampled, dropped or
kept and counted, and the prompt formatting, bucketing and stop strings behave."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlaif.config import load_config
from rlaif.errors import UserError
from rlaif.io import manifest, shards
from rlaif.models.generation import truncate_at_stop
from rlaif.models.prompt_text import format_prompts, prompt_token_ids
from rlaif.runner import run_stage
from rlaif.stages import generate

REPO = Path(__file__).resolve().parents[2]


def tiny(tmp_path, *overrides):
    return load_config(str(REPO / "configs/tiny.yaml"), [f"storage.root=file://{tmp_path}", *overrides])


def pairs(cfg) -> dict:
    url = f"{cfg.storage.root}/{cfg.run_id}/generate"
    m = manifest.require(url, "generate")
    return {s["__key__"]: (s["prompt.txt"], s["response_a.txt"], s["response_b.txt"]) for s in shards.read_all(url, m)}


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    cfg = tiny(tmp_path_factory.mktemp("one"))
    run_stage(cfg, "generate")
    return cfg, pairs(cfg)


def test_three_parts_equal_the_unsharded_run(tmp_path, unsharded):
    cfg1, expected = unsharded
    cfg = tiny(tmp_path, "generate.batch_size=6", "generate.length_bucketing=false")  # other batches too
    for index in (2, 0, 1):  # any order: the last part to finish commits the manifest
        assert manifest.read(f"{cfg.storage.root}/{cfg.run_id}/generate") is None
        run_stage(cfg, "generate", index, 3)
    got = pairs(cfg)
    assert len(got) == 32 and got == expected  # nothing lost, nothing duplicated, every text the same
    m = manifest.read(f"{cfg.storage.root}/{cfg.run_id}/generate")
    assert m["summary"]["parts"] == 3 and m["summary"]["pairs"] == 32 and m["num_samples"] == 32
    run_stage(cfg, "generate", 1, 3)  # a retried pod: cache hit on the committed manifest, nothing rewritten
    assert manifest.read(f"{cfg.storage.root}/{cfg.run_id}/generate")["digest"] == m["digest"]


def test_more_parts_than_prompts_leave_some_parts_empty(tmp_path, unsharded):
    # nproc or --num-shards above the prompt count: the parts without a prompt commit nothing (were a traceback)
    _, expected = unsharded
    cfg = tiny(tmp_path, "generate.max_prompts=2")
    for index in range(5):
        run_stage(cfg, "generate", index, 5)
    got = pairs(cfg)
    assert len(got) == 2 and all(expected[key] == pair for key, pair in got.items())
    assert manifest.read(f"{cfg.storage.root}/{cfg.run_id}/generate")["summary"]["parts"] == 5


def test_parts_of_other_settings_or_another_split_are_not_merged(tmp_path, capsys):
    few = ("generate.max_prompts=4",)
    run_stage(tiny(tmp_path, *few), "generate", 0, 2)
    other = tiny(tmp_path, *few, "generate.max_new_tokens=13")
    run_stage(other, "generate", 1, 2)  # parts of a re-run may start at other times: part 0's turn is still to come
    assert "part 0 of 2 holds the output of other settings; the manifest is committed once part 0 has run with these" \
        in capsys.readouterr().out
    assert manifest.read(f"{other.storage.root}/{other.run_id}/generate") is None
    # a split into 3 replaces part 1's shards: the 2-part record that listed them goes with them
    run_stage(other, "generate", 1, 3)
    assert sorted(p.name for p in (tmp_path / "tiny/generate/parts").glob("part-*.json")) == [
        "part-00000-of-00002.json", "part-00001-of-00003.json"]
    run_stage(other, "generate", 0, 2)  # part 1 of 2 is gone: nothing merges over the replaced shards
    assert manifest.read(f"{other.storage.root}/{other.run_id}/generate") is None
    run_stage(tiny(tmp_path, *few), "generate")  # one process writes every part's shard names: no record survives
    assert not list((tmp_path / "tiny/generate/parts").glob("part-*.json"))


def test_any_pair_regenerates_alone(unsharded):
    cfg, expected = unsharded
    backend = generate.TransformersBackend(cfg)
    key = sorted(expected)[5]
    prompt, a, b = expected[key]
    text = backend.format([prompt])
    sample_a = backend.sample(text, [generate.sample_seed(cfg.seed, key, 0)])[0][0]
    assert sample_a == a


@pytest.mark.slow
def test_torchrun_ranks_split_the_prompts_and_rank0_merges(tmp_path, unsharded):
    _, expected = unsharded
    root = f"file://{tmp_path}"
    proc = subprocess.run([sys.executable, "-m", "rlaif", "launch", "generate", "--config", "configs/tiny.yaml",
                           "--storage-root", root, "--set", "generate.nproc=2"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "part 0/2" in proc.stdout and "part 1/2" in proc.stdout
    cfg = tiny(tmp_path)
    assert pairs(cfg) == expected
    assert manifest.read(f"{root}/tiny/generate")["summary"]["parts"] == 2


def test_identical_pairs_are_resampled_dropped_or_kept(tmp_path):
    greedy = ("generate.temperature=0", "generate.max_prompts=6")  # greedy: every sample of a prompt is the same
    cfg = tiny(tmp_path / "keep", *greedy, "generate.identical_pairs=keep")
    run_stage(cfg, "generate")
    summary = manifest.read(f"{cfg.storage.root}/tiny/generate")["summary"]
    assert summary["identical_pairs"] == 6 and summary["pairs"] == 6 and summary["resampled_pairs"] == 0
    assert all(a == b for _, a, b in pairs(cfg).values())
    for policy in ("resample", "drop"):
        with pytest.raises(UserError, match=f"temperature 0 is greedy.* identical_pairs {policy} would drop every"):
            tiny(tmp_path / policy, *greedy, f"generate.identical_pairs={policy}")  # refused before any work
        top_one = ("generate.top_k=1", "generate.max_prompts=6")  # sampled from one token: the same, found at run time
        cfg = tiny(tmp_path / policy, *top_one, f"generate.identical_pairs={policy}", "generate.max_resamples=2")
        with pytest.raises(UserError, match="every pair was dropped as identical"):
            run_stage(cfg, "generate")
        assert manifest.read(f"{cfg.storage.root}/tiny/generate") is None  # nothing a later stage would trust
    cfg = tiny(tmp_path / "sampled", "generate.max_prompts=16", "generate.max_new_tokens=2", "generate.top_k=2")
    run_stage(cfg, "generate")  # two tokens from the top two: many first samples collide, resampling separates them
    summary = manifest.read(f"{cfg.storage.root}/tiny/generate")["summary"]
    assert summary["identical_pairs"] > 0 and summary["resampled_pairs"] >= summary["identical_pairs"]
    assert summary["pairs"] == 16 - summary["dropped_identical"]
    assert all(a != b for _, a, b in pairs(cfg).values())


def test_bad_shard_arguments_are_refused(tmp_path):
    cfg = tiny(tmp_path)
    with pytest.raises(UserError, match="outside 0..2"):
        run_stage(cfg, "generate", 3, 3)


def test_length_buckets_stop_strings_and_chat_templates(unsharded):
    lengths = [5, 1, 9, 3, 7, 2]
    assert generate.micro_batches(lengths, 2, 4, True) == [[1, 5], [3, 0], [4, 2]]  # 2 prompts x 2 samples each
    assert generate.micro_batches(lengths, 2, 4, False) == [[0, 1], [2, 3], [4, 5]]
    assert truncate_at_stop("an answer. And more", [".", "\n"]) == "an answer"
    assert truncate_at_stop("no stop here", ["."]) == "no stop here"

    cfg, _ = unsharded
    backend = generate.TransformersBackend(cfg)
    assert backend.format(["hi"]) == ["Question: hi\nAnswer:"]  # the tiny tokenizer has no chat template
    backend.tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    assert format_prompts(backend.tokenizer, cfg.policy, ["hi"]) == ["<|user|>hi<|assistant|>"]
    cfg.policy.chat_template = False
    assert format_prompts(backend.tokenizer, cfg.policy, ["hi"]) == ["Question: hi\nAnswer:"]
    backend.tokenizer.chat_template = None
    cfg.policy.chat_template = None

    backend.g = backend.g.model_copy(update={"stop": [" the"], "max_new_tokens": 24})
    texts = [t for t, _ in backend.sample(backend.format(["what is the sea", "why rivers"] * 4), list(range(8)))]
    assert all(" the" not in f" {t}" or not t for t in texts)


def test_vllm_backend_seeds_every_request(monkeypatch, unsharded):
    """vLLM is not installable here (no GPU): a stand-in module checks the wiring (one request per sample, its own
    seed, the config's sampling settings, stop strings) and the clear error when vLLM is missing."""
    import types

    cfg, _ = unsharded
    cfg = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"backend": "vllm", "stop": ["\n"]})})
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(UserError, match="needs vLLM"):
        generate.VLLMBackend(cfg)

    calls = {}

    class LLM:
        def __init__(self, model, seed, trust_remote_code):
            calls["init"] = (model, seed, trust_remote_code)

        def get_tokenizer(self):
            return generate.TransformersBackend(cfg).tokenizer

        def generate(self, prompts, params, use_tqdm):
            calls["params"], calls["prompts"] = params, prompts
            out = lambda i: types.SimpleNamespace(text=f" reply {i}", token_ids=[1, 2])  # noqa: E731
            return [types.SimpleNamespace(outputs=[out(i)]) for i in range(len(prompts))]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw,
                                                                   TokensPrompt=lambda **kw: kw))
    backend = generate.VLLMBackend(cfg)
    assert backend.sample(["a", "b"], [11, 12]) == [("reply 0", 2), ("reply 1", 2)]
    # token ids, encoded as the in-process backend encodes them: vLLM would put a BOS of its own before text
    assert calls["prompts"] == [{"prompt_token_ids": ids} for ids in prompt_token_ids(backend.tokenizer, ["a", "b"])]
    assert [p["seed"] for p in calls["params"]] == [11, 12] and calls["params"][0]["stop"] == ["\n"]
    assert calls["params"][0]["top_k"] == -1 and calls["params"][0]["max_tokens"] == cfg.generate.max_new_tokens
