"""HTTP to one OpenAI-compatible server (vLLM, SGLang, ``llama-server``) for ``dflash regenerate --server``.

Contract:

* **Requests** are JSON over the standard library's HTTP client, each on a connection of its own; a
  request without an answer after ``timeout`` seconds fails. The URL may end in ``/v1`` or not. The API
  key, when there is one, travels only in the ``Authorization: Bearer`` header: no message, exception or
  log line holds it (nor a user name or password written into the URL).
* **Failures** raise :class:`RequestFailed` with a ``kind``: ``down`` (no connection could be made, or
  503: the server is not listening or not ready, e.g. while it restarts or loads the model),
  ``dropped`` (the connection broke or timed out mid-request, or the answer was not the JSON asked
  for), ``busy`` (429), ``error`` (another 5xx), ``auth`` (401, 403: the key), ``missing`` (404: no
  such endpoint or model) and ``refused`` (another 4xx: the request itself is wrong, e.g. longer than
  the server's context, and no retry can help). :data:`RETRY` are the kinds worth another try;
  :func:`backoff` says how long to wait before it.
* :meth:`Endpoint.chat` posts one turn to ``/v1/chat/completions`` and returns a :class:`Reply`: the
  content, whitespace-stripped as the in-process path strips it; the reasoning when the server returns it
  apart (``reasoning_content``, or vLLM's newer ``reasoning``), verbatim; the stop (``eos``, or ``length``
  at the token cap); and the tokens generated before the stop, as the in-process path counts them:
  ``usage.completion_tokens``, which counts the stop token on an ``eos`` stop (llama-server does, checked
  by the tests; vLLM keeps the stop token in its output ids too), less that token.
"""

from __future__ import annotations

import http.client
import json
import random
import urllib.error
import urllib.parse
import urllib.request
from typing import NamedTuple

from dflash_staged.errors import DflashError

RETRY = ("down", "dropped", "busy", "error")
BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 60.0


class RequestFailed(DflashError):
    def __init__(self, kind: str, text: str, retry_after: float | None = None):
        super().__init__(text)
        self.kind, self.retry_after = kind, retry_after


class Reply(NamedTuple):
    content: str
    reasoning: str | None
    stop: str  # "eos" or "length"
    new_tokens: int


def backoff(attempt: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
    """Seconds before try ``attempt + 1``: the server's ``Retry-After`` when it sent one (capped), else
    exponential from :data:`BACKOFF_BASE_S` up to :data:`BACKOFF_CAP_S`, with jitter (so that many
    conversations failing together do not come back together)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), BACKOFF_CAP_S)
    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, attempt - 1))
    return delay * (0.5 + 0.5 * (rng or random).random())


def shown(url: str) -> str:
    """The URL as messages show it: without a user name or password."""
    p = urllib.parse.urlsplit(url)
    if not p.hostname:
        return url
    host = f"[{p.hostname}]" if ":" in p.hostname else p.hostname
    return p._replace(netloc=host + (f":{p.port}" if p.port else "")).geturl()


def _retry_after(headers) -> float | None:
    try:
        return float(headers.get("Retry-After")) if headers and headers.get("Retry-After") else None
    except (TypeError, ValueError):  # an HTTP date: not worth parsing, back off as usual
        return None


def _http_kind(code: int) -> str:
    if code == 429:
        return "busy"
    if code in (401, 403):
        return "auth"
    if code == 404:
        return "missing"
    if code == 503:
        return "down"
    return "error" if code >= 500 else "refused"


class Endpoint:
    """One server; thread-safe (no state is shared between requests)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600.0):
        base = url.strip().rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise DflashError(f"--server {shown(base)!r}: give an http:// or https:// URL")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.url, self.timeout = shown(self.base), timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str, timeout: float | None = None) -> dict:
        return self._send(urllib.request.Request(self.base + path, headers=self._headers), path, timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        data = json.dumps(body, ensure_ascii=False).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self._headers, method="POST")
        return self._send(req, path, timeout)

    def _send(self, req, path: str, timeout: float | None) -> dict:
        where = f"{self.url}{path}"
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            try:
                detail = " ".join(e.read().decode(errors="replace").split())[:300]
            except (OSError, http.client.HTTPException):
                detail = ""
            kind = _http_kind(e.code)
            raise RequestFailed(
                kind, f"{where} answered {e.code}: {detail or e.reason}", _retry_after(e.headers)
            ) from None
        except urllib.error.URLError as e:  # raised while connecting or sending the request
            raise RequestFailed("down", f"{where}: {e.reason}") from None
        except (http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
            raise RequestFailed("dropped", f"{where}: connection dropped ({type(e).__name__}: {e})") from None
        try:
            out = json.loads(raw)
        except ValueError:
            raise RequestFailed("dropped", f"{where}: the answer is not JSON ({raw[:80]!r})") from None
        if not isinstance(out, dict):
            raise RequestFailed("dropped", f"{where}: the answer is not a JSON object ({raw[:80]!r})")
        return out

    def chat(self, body: dict) -> Reply:
        """One chat completion (``body`` holds model, messages and the sampling settings)."""
        r = self.post("/v1/chat/completions", body)
        try:
            choice = r["choices"][0]
            msg, finish = choice["message"], choice.get("finish_reason")
            content = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
            n = int(r["usage"]["completion_tokens"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise RequestFailed(
                "dropped", f"{self.url}/v1/chat/completions: not a chat completion: {json.dumps(r)[:200]}"
            ) from None
        if finish not in ("stop", "length"):
            raise RequestFailed(
                "refused",
                f"{self.url}: the answer ended with finish_reason {finish!r}, not a stop or the cap",
            )
        stop = "eos" if finish == "stop" else "length"
        return Reply(content.strip(), reasoning, stop, max(0, n - (stop == "eos")))
