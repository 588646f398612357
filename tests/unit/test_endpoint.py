"""The one bounded GET behind every "does this server answer" check (KFP, MLflow, a model service), against real
sockets on loopback: an HTTP error status is an answer, silence and refusal are not, and no credential is shown; a
model service's answers are read whole and checked for what is taken from them."""
from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from rlaif.errors import UserError
from rlaif.io import endpoint

BROKEN = {"empty": b'{"choices": []}', "none": b'{"id": "x"}', "number": b'{"choices": [{"text": 42}]}',
          "list": b'[1, 2]'}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the standard library's name)
        self.send_response(200 if self.path == "/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}' if self.path == "/models" else b"no")

    def do_POST(self):  # noqa: N802
        """A completion whose body arrives in several writes, a moment apart (a proxy, a slow network); a prompt
        naming one of BROKEN gets that answer."""
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        body = BROKEN.get(prompt, b'{"choices": [{"text": "' + b"x" * 70_000 + b'"}]}')
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 20_000):
            self.wfile.write(body[start:start + 20_000])
            self.wfile.flush()
            time.sleep(0.05)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def silent():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_any_http_status_is_an_answer(server):
    assert endpoint.get(server + "/models", 5) == (200, b'{"data": []}')
    assert endpoint.get(server + "/missing", 5)[0] == 404


def test_silence_refusal_and_malformed_urls_are_no_answer(silent):
    started = time.monotonic()
    with pytest.raises(endpoint.NoAnswer, match=r"^did not answer within 0.5s$"):
        endpoint.get(silent, 0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(endpoint.NoAnswer, match=r"cannot be reached \(ConnectionRefusedError"):
        endpoint.get("http://127.0.0.1:9/health", 5)
    with pytest.raises(endpoint.NoAnswer, match="cannot be reached"):
        endpoint.get("htp:/nowhere", 5)


def test_credentials_never_reach_the_reason_or_the_request():
    assert endpoint.without_credentials("https://user:secret@host:8443/x") == "https://host:8443/x"
    with pytest.raises(endpoint.NoAnswer) as refused:
        endpoint.get("http://user:secret@127.0.0.1:9", 5)
    assert "secret" not in str(refused.value)


def test_the_service_client_check_says_which_failure(server, silent):
    from types import SimpleNamespace

    from rlaif.serving.client import ServiceClient

    def client(base_url):
        settings = SimpleNamespace(base_url=base_url, api_key_env=None, timeout_s=0.5)
        return ServiceClient(settings, "generate.endpoint")

    assert client(server).get("/models") == {"data": []}
    with pytest.raises(UserError, match=r"did not answer as a model service \(HTTP 404\): check generate.endpoint"):
        client(server).get("/v1/models")
    with pytest.raises(UserError, match=r"at http://\*\*\*@127.0.0.1:\d+/models did not answer within 0.5s: start it"):
        client(silent.replace("http://", "http://me:pw@")).get("/models")


def test_a_body_sent_in_pieces_is_read_to_its_end(server):
    """The client read only what had arrived with the first packet and called a valid answer "not JSON"."""
    from types import SimpleNamespace

    from rlaif.serving.client import ServiceClient

    settings = SimpleNamespace(base_url=server, api_key_env=None, timeout_s=10, concurrency=2, max_retries=0,
                               backoff_s=0.1)
    client = ServiceClient(settings, "label.openai")
    answers = client.post_all("/completions", [{"prompt": "a"}, {"prompt": "b"}])
    assert [len(answer["choices"][0]["text"]) for answer in answers] == [70_000, 70_000]
    # An answer without a completion's text (a served judge or policy) is one line, not an IndexError or KeyError
    for broken in BROKEN:
        with pytest.raises(UserError, match=r"/completions answered without a completion's text \(.*\): check that "
                                            "label.openai.base_url is an OpenAI-compatible completions API"):
            client.completions([{"prompt": "a"}, {"prompt": broken}])


def test_a_retry_waits_a_finite_time_and_a_timeout_names_timeout_s():
    # Retry-After: nan was slept as asyncio.sleep(nan), which wakes at no defined time (67 s in a probe, not 1 s)
    from types import SimpleNamespace

    from rlaif.serving.client import ServiceClient

    settings = SimpleNamespace(base_url="http://127.0.0.1:9/v1", api_key_env=None, timeout_s=3, concurrency=1,
                               max_retries=2, backoff_s=0.1)
    client = ServiceClient(settings, "label.openai")
    assert client._delay(0, "2") == 2.0 and client._delay(0, "600") == 60.0 and client._delay(0, "0") == 0.0
    for header in ("nan", "inf", "-inf", "-3", "Wed, 21 Oct 2015 07:28:00 GMT", None):
        assert 0.05 <= client._delay(0, header) <= 0.15, header  # our own backoff instead
    slow = str(client._gave_up("http://x/v1/completions", 3, "TimeoutError"))
    assert "failed 3 times (last: TimeoutError)" in slow and "raise label.openai.timeout_s (now 3 s)" in slow
    assert "timeout_s" not in str(client._gave_up("u", 1, "HTTP 500")) and "failed once" in str(
        client._gave_up("u", 1, "HTTP 500"))


def test_a_served_judges_log_probs_that_are_not_numbers_are_one_line():
    from rlaif.judges.hf import answer_logprobs

    assert answer_logprobs({"logprobs": {"top_token_ids": [[[5, -0.5], [6, -2.0]]]}}, [5, 6]) == [-0.5, -2.0]
    with pytest.raises(UserError, match="did not return the answers' own log-probs"):  # never a bound in its place
        answer_logprobs({"logprobs": {"top_token_ids": [[[5, -0.5], [6, -2.0]]]}}, [5, 7])
    for top in ([[]], [[[5, "x"], [6, "y"]]], [[[5, float("nan")]]], [[[5, 0.5]]], []):
        with pytest.raises(UserError, match="the judge service returned no token-id log-probs"):
            answer_logprobs({"logprobs": {"top_token_ids": top}}, [5, 6])


def test_a_served_policys_token_count_without_usage_comes_from_the_tokenizer():
    """usage is optional in the API: its absence was a KeyError under torchrun."""
    from transformers import AutoTokenizer

    from rlaif.models.loading import minilm_dir
    from rlaif.stages.generate import EndpointBackend

    backend = object.__new__(EndpointBackend)  # its constructor asks a live service who it is
    backend.tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    answer = {"choices": [{"text": "hello there world"}]}
    assert backend.completion_tokens({**answer, "usage": {"completion_tokens": 7}}) == 7
    for usage in ({}, {"usage": None}, {"usage": {"completion_tokens": "many"}},
                  {"usage": {"completion_tokens": True}}):
        assert backend.completion_tokens({**answer, **usage}) == 3
