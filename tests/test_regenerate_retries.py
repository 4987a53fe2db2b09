"""``dflash regenerate --server``'s retries, skips and reasoning field, against a small scripted HTTP server
on loopback (the failures a real server gives only under load: 429, 5xx, dropped connections), and the
matching of a served model to the target. The real-server tests are in ``test_regenerate_server.py``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_staged.config import TargetConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.target.dims import TargetDims
from dflash_staged.regenerate import client
from dflash_staged.regenerate.checks import Served, model_name, pick_model
from dflash_staged.regenerate.conversations import Conversation
from dflash_staged.regenerate.options import GenOptions, ServerOptions
from dflash_staged.regenerate.remote import run_remote


def completion(content="an answer", finish="stop", tokens=3, **extra) -> dict:
    msg = {"role": "assistant", "content": content, **extra}
    return {"choices": [{"message": msg, "finish_reason": finish}], "usage": {"completion_tokens": tokens}}


class Scripted:
    """A loopback HTTP server answering each POST with ``script(n, body)``: (status, headers, JSON) or
    ``"drop"`` (close the connection without an answer). Records the bodies and Authorization headers."""

    def __init__(self, script):
        self.script, self.bodies, self.auth = script, [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                outer.auth.append(self.headers.get("Authorization"))
                got = outer.script(len(outer.bodies), body)
                if got == "drop":
                    self.close_connection = True
                    return
                status, headers, payload = got
                data = json.dumps(payload).encode()
                self.send_response(status)
                for k, v in {**headers, "Content-Type": "application/json"}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_BASE_S", 0.001)


def run(tmp_path, script, turns=1, key=None, **server):
    """Answer one conversation through a scripted server; (outcome, the server, the part file's records)."""
    fake = Scripted(script)
    msgs = [{"role": "user", "content": f"question {i}"} for i in range(turns)]
    conv = Conversation(7, msgs, {})
    o = GenOptions(target=TargetConfig(model="m"), out=tmp_path / "out.jsonl", devices=[])
    s = ServerOptions(urls=[fake.url], **{"max_attempts": 3, "server_wait_s": 30.0, **server})
    try:
        r = run_remote([conv], o, s, [Served(client.Endpoint(fake.url, key), "m", 1, "tokens")], 1, 0)
    finally:
        fake.close()
    parts = [
        json.loads(x)
        for f in (tmp_path / "out.jsonl.parts").glob("*.jsonl")
        for x in f.read_text().splitlines()
    ]
    return r, fake, parts


def test_429_is_retried_after_the_servers_retry_after(tmp_path):
    busy = (429, {"Retry-After": "0"}, {"error": "busy"})
    r, fake, parts = run(tmp_path, lambda n, b: busy if n <= 2 else (200, {}, completion()))
    assert len(fake.bodies) == 3 and r.answered == 1 and not r.skipped
    (rec,) = parts
    assert rec["messages"][-1] == {"role": "assistant", "content": "an answer"}
    assert rec["regenerated"]["stop"] == ["eos"] and rec["regenerated"]["new_tokens"] == [2]


def test_a_conversation_that_keeps_failing_is_skipped_after_its_attempts_and_never_written(tmp_path):
    """The second turn keeps failing (500): the conversation is skipped whole, its first answer unwritten."""

    def script(n, body):
        return (200, {}, completion()) if n == 1 else (500, {}, {"error": "boom"})

    r, fake, parts = run(tmp_path, script, turns=2)
    assert len(fake.bodies) == 1 + 3  # the first turn, then three tries of the second
    assert list(r.skipped) == [7] and "3 attempts failed, the last:" in r.skipped[7] and "500" in r.skipped[7]
    assert parts == [] and r.answered == 0


def test_dropped_connections_are_retried_and_503_waits_without_spending_attempts(tmp_path):
    """A connection closed without an answer counts as an attempt; 503 (a server loading or restarting)
    is waited out: four 503 with only three attempts allowed still get the answer."""
    plan = ["drop", (503, {}, {"error": "loading"})] + [(503, {}, {"error": "loading"})] * 3

    def script(n, body):
        return plan[n - 1] if n <= len(plan) else (200, {}, completion())

    r, fake, parts = run(tmp_path, script)
    assert len(fake.bodies) == len(plan) + 1 and r.answered == 1 and not r.skipped


def test_a_server_down_longer_than_the_wait_is_given_up_and_its_work_kept(tmp_path):
    r, fake, parts = run(tmp_path, lambda n, b: (503, {}, {"error": "loading"}), server_wait_s=0.05)
    assert r.left == 1 and list(r.gone) and not r.skipped and parts == []


def test_a_refused_key_stops_the_run_and_the_key_is_sent_but_never_shown(tmp_path):
    r, fake, _ = run(tmp_path, lambda n, b: (401, {}, {"error": "Invalid API Key"}), key="k-123")
    assert fake.auth == ["Bearer k-123"] and "401" in r.fatal and "k-123" not in r.fatal
    assert len(fake.bodies) == 1  # no retry: every conversation would fail alike


THINK_STORED = {"role": "assistant", "content": "answer 1", "reasoning_content": "Let me think."}


@pytest.mark.parametrize(
    "server_shape",
    [
        {"content": " answer {n} ", "reasoning_content": "\nLet me think.\n"},  # llama-server, SGLang
        {"content": "answer {n}", "reasoning": "Let me think."},  # vLLM's newer field
        {"content": "<think>\nLet me think.\n</think>\n\nanswer {n}"},  # a server without a parser
    ],
)
def test_reasoning_is_stored_in_one_shape_whatever_the_server_returns(tmp_path, server_shape):
    """However a server returns the thinking, the record holds it in one shape (``reasoning_content``, the
    field chat templates read; the answer alone in ``content``), the next turn is asked with it in the
    history, and the sampling settings are sent explicitly (no server default applies)."""

    def script(n, body):
        shape = {k: v.format(n=n) for k, v in server_shape.items()}
        return 200, {}, completion(**shape)

    r, fake, parts = run(tmp_path, script, turns=2)
    (rec,) = parts
    assert rec["messages"][1] == THINK_STORED
    assert fake.bodies[1]["messages"][1] == THINK_STORED
    sent = fake.bodies[0]
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"], sent["max_tokens"]) == (
        0.0,
        1.0,
        -1,
        0.0,
        512,
    )
    assert "seed" not in sent  # greedy


def test_the_in_process_path_stores_reasoning_in_the_same_shape(tmp_path):
    """The in-process worker decodes the target's tokens to ``<think>...</think>`` text: the record holds
    the shape the server path stores."""
    import torch

    from dflash_staged.regenerate.worker import answer

    class Tok:
        pad_token_id = 0

        def apply_chat_template(self, messages, **kw):
            return "|".join(m["content"] for m in messages)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [5] * len(text.split("|"))}

        def decode(self, ids, skip_special_tokens=True):
            return "<think>\nLet me think.\n</think>\n\nanswer 1"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, **kw):
            return torch.cat([input_ids, torch.tensor([[7, 8, 2]] * input_ids.shape[0])], 1)

    o = GenOptions(TargetConfig(model="m"), tmp_path / "o.jsonl", ["cpu"], max_new_tokens=3)
    (rec,) = answer(Model(), Tok(), [Conversation(1, [{"role": "user", "content": "q"}], {})], o, [2])
    assert rec["messages"][1] == THINK_STORED and rec["regenerated"]["new_tokens"] == [2]


def test_a_bug_in_a_thread_is_raised_with_its_own_traceback(tmp_path, monkeypatch):
    """An unexpected exception in a conversation's thread stops the run and reaches the caller as itself
    (the error boundary then shows its traceback), never as a one-line user error."""
    from dflash_staged.regenerate import remote

    def broken(self, sv, conv, rng):
        return {"a": 1}["b"]  # a KeyError: a bug, not a failure of the server

    monkeypatch.setattr(remote.RemoteRun, "_answer", broken)
    with pytest.raises(KeyError) as e:
        run(tmp_path, lambda n, b: (200, {}, completion()))
    assert any(f.name == "broken" for f in __import__("traceback").extract_tb(e.value.__traceback__))


def test_backoff_grows_to_its_cap_and_follows_retry_after():
    delays = [client.backoff(k) for k in range(1, 30)]
    assert all(0 < d <= client.BACKOFF_CAP_S for d in delays) and delays[-1] >= client.BACKOFF_CAP_S / 2
    assert (
        client.backoff(3, retry_after=7.0) == 7.0
        and client.backoff(3, retry_after=1e6) == client.BACKOFF_CAP_S
    )


# ---------------------------------------------------------------------------------------------- the model
DIMS = TargetDims(num_layers=36, hidden_size=4096, vocab_size=151936)


@pytest.mark.parametrize(
    "served",
    [
        {"id": "Qwen/Qwen3-8B", "root": "Qwen/Qwen3-8B"},  # vLLM serving the hub id
        {"id": "qwen3", "root": "/models/Qwen3-8B"},  # vLLM with --served-model-name: the path names it
        {"id": "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/ab12"},  # SGLang, cache path
        {"id": "/m/q.gguf", "meta": {"n_vocab": 151936, "n_embd": 4096}},  # llama-server: its metadata
    ],
)
def test_the_served_target_is_recognised(served):
    assert pick_model("http://h", {"data": [served]}, "Qwen/Qwen3-8B", DIMS, None) == served["id"]


@pytest.mark.parametrize(
    "served,why",
    [
        ({"id": "meta-llama/Llama-3.1-8B", "root": "meta-llama/Llama-3.1-8B"}, "by name: none is 'qwen3-8b'"),
        ({"id": "/m/qwen3-8b.gguf", "meta": {"n_vocab": 151936, "n_embd": 2560}}, "hidden size 2560"),
    ],
)
def test_another_served_model_is_refused_in_one_line(served, why):
    with pytest.raises(DflashError, match="not the target Qwen/Qwen3-8B") as e:
        pick_model("http://h", {"data": [served]}, "Qwen/Qwen3-8B", DIMS, None)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_served_model_picks_by_name_yet_llama_metadata_still_counts():
    listing = {"data": [{"id": "alias"}, {"id": "other"}]}
    assert pick_model("http://h", listing, "Qwen/Qwen3-8B", DIMS, "alias") == "alias"
    with pytest.raises(DflashError, match="does not serve --served-model 'x'"):
        pick_model("http://h", listing, "Qwen/Qwen3-8B", DIMS, "x")
    wrong = {"data": [{"id": "alias", "meta": {"n_vocab": 32000, "n_embd": 4096}}]}
    with pytest.raises(DflashError, match="another model"):
        pick_model("http://h", wrong, "Qwen/Qwen3-8B", DIMS, "alias")
    assert model_name("models--Qwen--Qwen3-8B/snapshots/x") == model_name("/a/QWEN3-8B.gguf") == "qwen3-8b"
