"""One bounded GET (or POST), for the checks made before any work (a KFP API server, an MLflow server, a model
service): every way a server can fail to answer (refused, unresolvable, silent past the time limit, a malformed URL,
a broken reply) becomes NoAnswer with a few words that say which, any credentials in the URL masked."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from rlaif.errors import one_line, redact

MAX_BODY_BYTES = 4 * 2**20  # a health check's or a model list's reply; more is not the answer asked for


class NoAnswer(Exception):
    """A request that got no HTTP answer; str() says why in a few words. `silent`: connected (or trying to) but no
    answer in time, which a service warming up also does, unlike a refusal or an unknown host."""

    def __init__(self, why: str, silent: bool = False):
        super().__init__(why)
        self.silent = silent


def without_credentials(url: str) -> str:
    """The URL with any user:password@ removed (urllib would send them as basic auth, which no caller means)."""
    parts = urlsplit(url.strip())
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl()


def get(url: str, timeout_s: float, headers: dict | None = None, proxies: bool = True) -> tuple[int, bytes]:
    """(HTTP status, body) of one GET; any status is an answer, 4xx and 5xx included (with the server's own words).
    `proxies=False` goes direct, as clients that ignore $HTTP_PROXY do."""
    return _answer(urllib.request.Request(url, headers=headers or {}), timeout_s, proxies)


def post_json(url: str, body: dict, timeout_s: float, headers: dict | None = None,
              proxies: bool = True) -> tuple[int, bytes]:
    """(HTTP status, body) of one POST of `body` as JSON, as `get` answers. A redirect is an answer too (3xx), not
    followed: urllib would resend the POST as a GET with our Authorization header, to any host."""
    headers = {**(headers or {}), "Content-Type": "application/json"}
    return _answer(urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST"),
                   timeout_s, proxies, _NotFollowed())


class _NotFollowed(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # urllib then raises the 3xx as an HTTPError: an answer


def _answer(request: urllib.request.Request, timeout_s: float, proxies: bool,
            *handlers: urllib.request.BaseHandler) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(*handlers, *([] if proxies else [urllib.request.ProxyHandler({})]))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status, response.read(MAX_BODY_BYTES)
    except urllib.error.HTTPError as answer:
        with answer:
            try:
                return answer.code, answer.read(MAX_BODY_BYTES)
            except (OSError, http.client.HTTPException):  # the status came; its body did not
                return answer.code, b""
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError and TimeoutError are OSErrors
        raise NoAnswer(_why(exc, timeout_s), silent=isinstance(getattr(exc, "reason", exc), TimeoutError)) from None


def _why(exc: Exception, timeout_s: float) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, TimeoutError):
        return f"did not answer within {timeout_s:g}s"
    detail = one_line(reason, 120)
    return redact(f"cannot be reached ({type(reason).__name__}: {detail})" if detail else
                  f"cannot be reached ({type(reason).__name__})")
