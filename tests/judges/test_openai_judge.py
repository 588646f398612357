"""The endpoint judge against a real HTTP server on loopback serving the tiny judge: injected 429s, 500s and
timeouts are retried without losing, reordering or duplicating a pair; hard errors and a dead endpoint are one
clear line; the API key travels only in the request header."""
import math
import socket

import pytest
import torch
from judge_helpers import JudgeServer, settings, write_pairs

from rlaif.config import load_config
from rlaif.errors import UserError
from rlaif.io import manifest, shards
from rlaif.judges import debiased, make_judge
from rlaif.judges.hf import HFJudge
from rlaif.runner import run_stage

N = 12
PROMPTS = [f"question {i}" for i in range(N)]
FIRST = [f"answer {i}" for i in range(N)]
SECOND = [f"other {i} " * (1 + i % 3) for i in range(N)]
PRINCIPLES = ["Be helpful.", "Be honest."] * (N // 2)
FAULTS = {2: "429", 3: "500", 5: "timeout", 9: "500", 10: "429", 14: "timeout", 20: "500"}


def endpoint_settings(server, **openai):
    return settings(judge="openai", openai={"base_url": server.base_url, "model": "tiny", "concurrency": 4,
                                            "timeout_s": 1.0, "backoff_s": 0.01, "top_logprobs": 20, **openai})


@pytest.fixture(scope="module")
def clean_server(judge_model_dir):
    server = JudgeServer(judge_model_dir)
    yield server
    server.close()


def test_logprob_labels_match_the_local_judge(clean_server, judge_model_dir):
    judge = make_judge(endpoint_settings(clean_server), 8)
    p = judge.prefer_first(PROMPTS, FIRST, SECOND, PRINCIPLES)
    assert judge.stats["answers_from_logprobs"] == N and judge.stats["retries"] == 0
    local = HFJudge(settings(judge="hf", hf={"model": str(judge_model_dir)}), 8).prefer_first(
        PROMPTS, FIRST, SECOND, PRINCIPLES)
    torch.testing.assert_close(p, local, atol=1e-4, rtol=0)


def test_injected_429_500_and_timeouts_are_retried_without_losing_a_pair(clean_server, judge_model_dir):
    expected, *_ = debiased(make_judge(endpoint_settings(clean_server), 8), PROMPTS, FIRST, SECOND, PRINCIPLES)
    flaky = JudgeServer(judge_model_dir, faults=FAULTS, sleep_s=2.0)
    try:
        judge = make_judge(endpoint_settings(flaky), 8)
        p, *_ = debiased(judge, PROMPTS, FIRST, SECOND, PRINCIPLES)
    finally:
        flaky.close()
    torch.testing.assert_close(p, expected, atol=1e-6, rtol=0)
    assert judge.stats["retries"] == len(FAULTS)
    assert judge.stats["requests"] == 2 * N + len(FAULTS) == len(flaky.requests)


def test_label_stage_on_a_flaky_endpoint_writes_each_pair_once_and_no_key(tmp_path, judge_model_dir, clean_server,
                                                                          monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test-not-a-real-key")
    flaky = JudgeServer(judge_model_dir, faults=FAULTS, sleep_s=2.0)
    cfg = load_config(None, [f"storage.root=file://{tmp_path}", "label.judge=openai",
                             f"label.openai.base_url={flaky.base_url}", "label.openai.model=tiny",
                             "label.openai.timeout_s=1", "label.openai.backoff_s=0.01",
                             "label.openai.api_key_env=JUDGE_KEY", "label.openai.top_logprobs=20", "label.batch_size=5",
                             "label.shard_size=4"])
    write_pairs(cfg, PROMPTS, FIRST, SECOND)
    try:
        run_stage(cfg, "label")
    finally:
        flaky.close()
    out = manifest.read(f"file://{tmp_path}/{cfg.run_id}/label")
    labels = shards.read_all(f"file://{tmp_path}/{cfg.run_id}/label", out)
    assert [s["__key__"] for s in labels] == [f"p{i:03d}" for i in range(N)]
    assert out["summary"]["endpoint"]["retries"] == len(FAULTS) and out["summary"]["pairs"] == N
    assert {r["auth"] for r in flaky.requests} == {"Bearer sk-test-not-a-real-key"}
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"sk-test-not-a-real-key" not in path.read_bytes(), path


def test_a_dead_endpoint_and_a_refusal_are_one_clear_error(judge_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    dead = settings(judge="openai", openai={"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_retries": 2,
                                            "backoff_s": 0.01})
    with pytest.raises(UserError, match=r"failed 3 times \(last: Client.*Error\)"):
        make_judge(dead, 8).prefer_first(["q"], ["a"], ["b"], ["p"])
    refusing = JudgeServer(judge_model_dir, faults={1: "401"})
    try:
        with pytest.raises(UserError, match="refused the request with HTTP 401"):
            make_judge(endpoint_settings(refusing), 8).prefer_first(["q"], ["a"], ["b"], ["p"])
        assert len(refusing.requests) == 1  # not retried
    finally:
        refusing.close()


def test_chat_api_without_logprobs_parses_the_answer(judge_model_dir):
    server = JudgeServer(judge_model_dir, logprobs=False)
    try:
        judge = make_judge(endpoint_settings(server, api="chat"), 8)
        p = judge.prefer_first(PROMPTS[:4], FIRST[:4], SECOND[:4], PRINCIPLES[:4])
    finally:
        server.close()
    assert server.requests[0]["path"] == "/v1/chat/completions" and "messages" in server.requests[0]["body"]
    parsed = judge.stats["answers_parsed"]
    assert parsed + judge.stats["answers_unreadable"] == 4 and judge.stats["answers_from_logprobs"] == 0
    assert set(p.tolist()) <= {0.0, 0.5, 1.0}


def test_chain_of_thought_asks_for_the_rationale_then_the_answer(clean_server):
    before = len(clean_server.requests)
    judge = make_judge(endpoint_settings(clean_server).model_copy(update={"chain_of_thought": True,
                                                                          "rationale_tokens": 8}), 8)
    p = judge.prefer_first(PROMPTS[:2], FIRST[:2], SECOND[:2], PRINCIPLES[:2])
    sent = clean_server.requests[before:]
    rationale_asks = [r["body"] for r in sent if r["body"]["max_tokens"] == 8]
    answer_asks = [r["body"] for r in sent if r["body"]["max_tokens"] == 1]
    assert len(rationale_asks) == len(answer_asks) == 2 and p.shape == (2,)
    assert all(b["prompt"].endswith("Rationale:") and "logprobs" not in b for b in rationale_asks)
    assert all("\nRationale: " in b["prompt"] and b["prompt"].endswith("Preferred response:") for b in answer_asks)


def test_an_answer_listed_alone_in_its_top_logprobs_is_read_as_confident():
    # A server that lists only the chosen token (fewer alternatives than asked, or one when capped): the other answer's
    # bound was that very token's log-prob, so every confident answer read as a tie (0.5) and the stage stopped.
    from rlaif.judges.openai import OpenAIJudge

    judge = OpenAIJudge(settings(judge="openai", openai={"base_url": "http://127.0.0.1:9/v1", "model": "m"}))
    assert judge._p_first("1", {"1": -0.01}) == pytest.approx(1 / (1 + (1 - math.exp(-0.01)) / math.exp(-0.01)))
    assert judge._p_first("2", {"2": 0.0}) == pytest.approx(0.0, abs=1e-9)  # all the mass listed, rounded to 1
    # Several listed: the unlisted answer gets at most the least likely listed one and at most the mass left.
    assert judge._p_first("1", {"1": -0.1, "x": -2.5}) == pytest.approx(
        1 / (1 + (1 - math.exp(-0.1) - math.exp(-2.5)) / math.exp(-0.1)))
    assert judge._p_first("1", {"1": -2.0, "x": -2.1, "y": -2.2}) == pytest.approx(1 / (1 + math.exp(-2.2 + 2.0)))
    assert judge.stats["answers_from_logprobs"] == 4


def test_replies_a_label_cannot_be_computed_from_are_one_clear_error():
    # a traceback (math domain error, int(nan), AttributeError) or a silent NaN label before
    from rlaif.judges.openai import OpenAIJudge

    judge = OpenAIJudge(settings(judge="openai", openai={"base_url": "http://127.0.0.1:9/v1", "model": "m"}))
    # vLLM writes an impossible token's log-prob as -9999: a clear preference, not log(0)
    assert judge._p_first(*judge._parse({"choices": [{"text": "1", "logprobs": {
        "top_logprobs": [{"1": 0.0, "2": -9999.0}]}}]})) == pytest.approx(1.0)
    assert judge._p_first("2", {"1": -1000.0, "2": -800.0}) == pytest.approx(1.0 / (1.0 + 2.718281828**200))
    for reply in ({"choices": [{"text": 1}]}, {"choices": [{"text": None}]},
                  {"choices": [{"text": "1", "logprobs": {"top_logprobs": [{"1": float("nan"), "2": -1.0}]}}]},
                  {"choices": [{"text": "1", "logprobs": {"top_logprobs": [{"1": "-0.1"}]}}]},
                  {"choices": [{"text": "1", "logprobs": {"top_logprobs": [[["1", -0.1]]]}}]},
                  {"choices": [{"text": "1", "logprobs": {"top_logprobs": [{"1": 3.0}]}}]}):
        with pytest.raises(UserError, match="returned an unexpected response"):
            judge._parse(reply)
    chat = OpenAIJudge(settings(judge="openai", openai={"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                                        "api": "chat"}))
    with pytest.raises(UserError, match="returned an unexpected response"):
        chat._parse({"choices": [{"message": {"content": [{"type": "text", "text": "1"}]}}]})
    for bad, needle in (({"top_logprobs": 1}, "greater than or equal to 2"),  # one log-prob: every label 0.5
                        ({"base_url": "localhost:8000/v1"}, "must be an http:// or https:// URL"),
                        ({"max_retries": 1000}, "less than or equal to 100")):
        with pytest.raises(UserError, match=needle):
            load_config("configs/tiny.yaml", [f"label.openai.{k}={v}" for k, v in bad.items()])


@pytest.mark.parametrize("answer", ["I think both are fine", "10", "2 is worse than 1"])
def test_a_judge_that_answers_neither_1_nor_2_is_refused(judge_model_dir, answer):
    """Answers that only began with 1 or 2 ("10", "2023", "2 is worse than 1") were read as confident votes."""
    server = JudgeServer(judge_model_dir, logprobs=False, answer=answer)
    try:
        judge = make_judge(endpoint_settings(server, api="chat"), 8)
        with pytest.raises(UserError, match="answered 8 of its first 8 comparisons with neither 1 nor 2 .* or raise "
                                            "label.openai.max_unreadable_fraction"):
            judge.prefer_first(PROMPTS[:8], FIRST[:8], SECOND[:8], PRINCIPLES[:8])
        tolerant = make_judge(endpoint_settings(server, api="chat", max_unreadable_fraction=1.0), 8)
        with pytest.raises(UserError, match="answered 8 of its first 8"):  # none read: a stop whatever the share
            tolerant.prefer_first(PROMPTS[:8], FIRST[:8], SECOND[:8], PRINCIPLES[:8])
        # the stop comes with the 8th answer, not after a batch of them: 8 answered, the other 3 in flight cancelled
        # (the 8th's slot can let one more start before the cancel reaches it)
        server.requests.clear()
        batch = 40
        with pytest.raises(UserError, match="answered 8 of its first 8"):
            make_judge(endpoint_settings(server, api="chat"), batch).prefer_first(
                *((column * batch)[:batch] for column in (PROMPTS, FIRST, SECOND, PRINCIPLES)))
        assert len(server.requests) <= 12, len(server.requests)
    finally:
        server.close()


def test_only_a_whole_answer_is_a_vote():
    """A parsed answer is 1 or 2 alone (with the marks chat models put around it), nothing longer."""
    from rlaif.judges.openai import OpenAIJudge

    judge = OpenAIJudge(settings(judge="openai", openai={"base_url": "http://127.0.0.1:9/v1", "model": "m"}))
    read = [judge._p_first(answer, None) for answer in ("1", "**2**", "Response 1", "Answer: 2", "2.", "1/2", "12")]
    assert read == [1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5] and judge.stats["answers_unreadable"] == 2


def test_the_unreadable_share_is_held_to_its_limit_from_the_50th_answer():
    """Seven answers in eight unreadable became 0.5 labels and the stage went on; one in eight among the first few
    answers is noise, not a broken judge."""
    from rlaif.judges.openai import OpenAIJudge

    def judge_answering(answers: list[str], **openai):
        judge = OpenAIJudge(settings(judge="openai", openai={"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                                             **openai}))
        judge.client.map = lambda work, texts: [judge._p_first(answer, None) for answer in answers[:len(texts)]]
        return judge

    def judged(judge, n: int):
        return judge.prefer_first(["q"] * n, ["a"] * n, ["b"] * n, ["Be helpful."] * n)

    assert judged(judge_answering(["1"] * 7 + ["maybe"]), 8).tolist() == [1.0] * 7 + [0.5]
    mostly_unreadable = ["maybe"] * 44 + ["2"] * 6
    with pytest.raises(UserError, match="answered 44 of its first 50 comparisons with neither 1 nor 2"):
        judged(judge_answering(mostly_unreadable), 50)
    assert judged(judge_answering(mostly_unreadable, max_unreadable_fraction=0.9), 50).shape == (50,)
