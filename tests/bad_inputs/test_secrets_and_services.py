"""Credentials never reach an error line (a URL's user, password, query and fragment values; any credential in the
environment or sent by us, even where a server echoes it back), URLs that would carry them are refused in the
config, and a judge behind an HTTP endpoint that is down, refuses our key or is no API is refused before generate."""
import contextlib
import http.server
import json
import threading

import pytest

from rlaif.errors import keep_secret, redact

TINY = "configs/tiny.yaml"
KEY = "sk-verysecret-0042"


class _EchoingServer(http.server.BaseHTTPRequestHandler):
    """401 with the Authorization header echoed back (as some gateways do), or a web page with HTTP 200."""
    mode = "401"

    def do_GET(self):  # noqa: N802 (the standard library's name)
        if self.mode.isdigit() and self.mode != "401":
            self.send_response(int(self.mode))
            self.end_headers()
        elif self.mode == "401":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(json.dumps({"error": {"message": f"bad key {self.headers['Authorization']}"}}).encode())
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>welcome</html>")

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    def start(mode: str) -> str:
        handler = type("Handler", (_EchoingServer,), {"mode": mode})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/v1"

    started = []
    yield start
    for httpd in started:
        httpd.shutdown()


def test_error_lines_mask_urls_credentials_and_every_secret_value(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-123456789")
    monkeypatch.setenv("SHORT_TOKEN", "x")  # too short to mask: it would blank ordinary words
    line = redact("http://u:pw@h:5000/p?token=abc&sig=def#frag=ghi): tok-123456789 x http://h/docs#usage")
    assert line == "http://***@h:5000/p?token=***&sig=***#frag=***): *** x http://h/docs#usage"
    keep_secret("custom-credential-77")  # a key read from a variable of any name, once sent
    assert redact("server said: Bearer custom-credential-77") == "server said: Bearer ***"


@pytest.mark.parametrize("override", ["label.openai.base_url=http://h:8000/v1?api_key=SECRETQUERY",
                                      "storage.endpoint_url=http://minio:9000/?X-Amz-Signature=SECRETSIG",
                                      "tracking.mlflow_tracking_uri=http://mlflow:5000/#token=SECRETFRAG"])
def test_urls_with_a_query_or_fragment_are_refused_in_the_config(cli, tmp_path, override):
    line = cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", override,
               needle="must not carry a query (?...) or fragment (#...)")
    assert "SECRET" not in line and not (tmp_path / "root").exists()


@pytest.mark.parametrize("mode, needle", [
    ("401", "/v1/models refused the request with HTTP 401: check the API key ($RLAIF_JUDGE_API_KEY) and "
            "label.openai.base_url"),
    ("html", "/v1/models answered with something other than JSON (b'<html>welcome</html>'): set label.openai.base_url "
             "to the API root"),
    ("down", "/v1/models cannot be reached (ConnectionRefusedError"),
])
def test_an_endpoint_judge_that_cannot_serve_is_refused_before_generate(cli, tmp_path, server, monkeypatch, mode,
                                                                         needle):
    monkeypatch.setenv("RLAIF_JUDGE_API_KEY", KEY)
    base_url = "http://127.0.0.1:9/v1" if mode == "down" else server(mode)
    line = cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", "label.judge=openai",
               "--set", f"label.openai.base_url={base_url}", "--set", "label.openai.model=m", needle=needle)
    assert KEY not in line
    assert not list((tmp_path / "root").rglob("manifest.json")) and not (tmp_path / "root/tiny/generate").exists()


def test_a_key_the_server_echoes_back_is_masked(server, monkeypatch, capsys):
    from types import SimpleNamespace

    from rlaif.cli import _user_error
    from rlaif.errors import UserError
    from rlaif.serving.client import ServiceClient

    monkeypatch.setenv("JUDGE_CREDENTIAL", KEY)  # a name that does not look like a credential's
    settings = SimpleNamespace(base_url=server("401"), api_key_env="JUDGE_CREDENTIAL", timeout_s=5, concurrency=1,
                               max_retries=0, backoff_s=0)
    with pytest.raises(UserError) as refused:
        ServiceClient(settings, "label.openai").post_all("/completions", [{"prompt": "x"}])
    assert f"bad key Bearer {KEY}" in str(refused.value)  # the server's own words, as the client got them
    assert _user_error(str(refused.value)) == 2
    printed = capsys.readouterr().err
    assert "bad key Bearer ***" in printed and KEY not in printed


@pytest.mark.parametrize("mode", ["503", "429", "404", "silent"])
def test_what_the_stage_waits_out_or_retries_passes_the_check(server, mode):
    """A service scaled to zero or warming up (silent, 503), rate-limited (429), or without /models (404): label's
    requests wait, retry or tell, so the check before generate lets them through; only down, a refused key and a
    page that is not JSON are refused then."""
    import socket
    from types import SimpleNamespace

    from rlaif.serving.client import ServiceClient

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        base_url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1" if mode == "silent" else server(mode)
        settings = SimpleNamespace(base_url=base_url, api_key_env="", timeout_s=0.5)
        ServiceClient(settings, "label.openai").check_answers()


class _ModelServer(http.server.BaseHTTPRequestHandler):
    """/models lists SERVED; a completion request answers as `mode` says: 'named' (vLLM, OpenAI, Ollama: 404 for a
    model it does not serve), 'any' (TGI, llama.cpp: any name), 'busy' (503), 'garbage' (200 with no choices),
    'redirect' (307 elsewhere), 'noroute' (a base_url short of the API root: 404 for /models and completions)."""
    mode, posts = "named", []

    def do_GET(self):  # noqa: N802 (the standard library's name)
        if self.mode == "noroute":
            return self._reply(404, {"detail": "Not Found"})
        self._reply(200, {"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.posts.append({"path": self.path, "body": body})
        if self.mode in ("busy", "garbage", "redirect", "noroute"):
            status, payload = {"busy": (503, {"error": "loading"}), "garbage": (200, {"object": "chat.completion"}),
                               "redirect": (307, {}), "noroute": (404, {"detail": "Not Found"})}[self.mode]
            return self._reply(status, payload, location="http://127.0.0.1:9/v1/chat/completions")
        if self.mode == "named" and body["model"] != SERVED:
            return self._reply(404, {"error": {"message": f"The model `{body['model']}` does not exist.",
                                               "code": "model_not_found"}})
        if self.path.endswith("/chat/completions"):
            top = [{"token": "1", "logprob": -0.1}, {"token": "2", "logprob": -2.4}]
            answer = {"token": "1", "logprob": -0.1, "top_logprobs": top}
            return self._reply(200, {"choices": [{"message": {"role": "assistant", "content": "1"},
                                                  "logprobs": {"content": [answer]}}]})
        self._reply(200, {"choices": [{"text": "1", "logprobs": {"tokens": ["1"], "top_logprobs": [{"1": -0.1}]}}]})

    def _reply(self, status: int, payload: dict, location: str = ""):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if 300 <= status < 400:
            self.send_header("Location", location)
        self.end_headers()
        self.wfile.write(json.dumps(payload).encode())

    def log_message(self, *args):
        pass


SERVED = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture
def model_server():
    def start(mode: str):
        handler = type("Handler", (_ModelServer,), {"mode": mode, "posts": []})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler.posts

    started = []
    yield start
    for httpd in started:
        httpd.shutdown()


def test_a_judge_model_the_service_does_not_serve_is_refused_before_generate(cli, tmp_path, model_server):
    base_url, posts = model_server("named")
    cli("run", "--config", TINY, "--storage-root", f"file://{tmp_path}/root", "--set", "label.judge=openai",
        "--set", f"label.openai.base_url={base_url}", "--set", "label.openai.model=qwen2.5-7b-instruct",
        "--set", "label.openai.api_key_env=''", "--set", "label.openai.api=chat",
        needle="/v1/chat/completions refused a one-token request for model 'qwen2.5-7b-instruct' with HTTP 404: "
               "'{\"error\": {\"message\": \"The model `qwen2.5-7b-instruct` does not exist.\"")
    assert len(posts) == 1 and posts[0]["body"]["max_tokens"] == 1 and posts[0]["body"]["logprobs"] is True
    assert not (tmp_path / "root/tiny/generate").exists()


@pytest.mark.parametrize("mode, model, api, posts_expected", [
    ("named", SERVED, "chat", 0),  # named in /models: nothing sent
    ("named", SERVED, "completions", 1),  # OpenAI lists chat models its completions route refuses: asked
    ("any", "whatever-name", "chat", 1),  # a server that answers any name: the request passes
    ("busy", "other", "chat", 1),  # warming up: label's requests wait and retry
    ("redirect", "other", "chat", 1),  # not followed (urllib would resend our key as a GET to any host)
])
def test_a_judge_model_the_service_takes_passes_the_check(model_server, mode, model, api, posts_expected):
    from rlaif.config import load_config
    from rlaif.judges import check_services

    base_url, posts = model_server(mode)
    cfg = load_config(TINY, ["label.judge=openai", f"label.openai.base_url={base_url}", f"label.openai.model={model}",
                             "label.openai.api_key_env=''", f"label.openai.api={api}"])
    check_services(cfg, "label")
    assert len(posts) == posts_expected
    if api == "completions":
        assert posts[0]["path"] == "/v1/completions" and posts[0]["body"]["max_tokens"] == 1
        assert "prompt" in posts[0]["body"] and isinstance(posts[0]["body"]["logprobs"], int)


def test_a_base_url_short_of_the_api_root_is_named(model_server):
    from rlaif.config import load_config
    from rlaif.errors import UserError
    from rlaif.judges import check_services

    base_url, _ = model_server("noroute")
    cfg = load_config(TINY, ["label.judge=openai", f"label.openai.base_url={base_url}", "label.openai.model=m",
                             "label.openai.api_key_env=''", "label.openai.api=chat"])
    with pytest.raises(UserError, match=r"with HTTP 404: .*Not Found.* check label.openai.model, label.openai.api "
                                        r"and label.openai.base_url \(the API root"):
        check_services(cfg, "label")


def test_a_silent_service_is_asked_once():
    """Silence is what a service warming up does: the check lets it pass after its GET, with no POST to wait for."""
    import socket

    from rlaif.config import load_config
    from rlaif.judges import check_services

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        base_url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        cfg = load_config(TINY, ["label.judge=openai", f"label.openai.base_url={base_url}", "label.openai.model=m",
                                 "label.openai.api_key_env=''", "label.openai.timeout_s=0.5"])
        check_services(cfg, "label")
        silent.setblocking(False)
        connections = []
        with contextlib.suppress(BlockingIOError):
            while True:
                connections.append(silent.accept()[0])
        assert len(connections) == 1  # the GET of /models; no POST after it
        for connection in connections:
            connection.close()


def test_a_reply_label_could_not_read_is_refused_before_generate(model_server):
    from rlaif.config import load_config
    from rlaif.errors import UserError
    from rlaif.judges import check_services

    base_url, _ = model_server("garbage")
    cfg = load_config(TINY, ["label.judge=openai", f"label.openai.base_url={base_url}", "label.openai.model=other",
                             "label.openai.api_key_env=''", "label.openai.api=chat"])
    with pytest.raises(UserError, match="returned an unexpected response"):
        check_services(cfg, "label")
