"""``dflash serve``'s checks and its reading of llama-server's answers and log, without a llama.cpp build:
scripted HTTP answers, written logs, reports in code."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_staged.errors import DflashError
from dflash_staged.serve.llamacpp import cpu
from dflash_staged.serve.llamacpp.server import LlamaServer
from dflash_staged.serve.report import agreement, prompt_result, recommend

from helpers import cli


def test_the_fastest_n_max_is_recommended_per_outtype_and_temperature():
    runs = [
        {"outtype": "f32", "temperature": 0.0, "n_max": 2, "speedup": 0.7},
        {"outtype": "f32", "temperature": 0.0, "n_max": 7, "speedup": 0.5},
        {"outtype": "f32", "temperature": 1.0, "n_max": 2, "speedup": 0.4},
        {"outtype": "f32", "temperature": 1.0, "n_max": 7, "speedup": 0.6},
        {"outtype": "q8_0", "temperature": 0.0, "n_max": 3, "speedup": 0.9},  # one n_max: nothing to pick
        {"outtype": "q8_0", "temperature": 0.0, "n_max": 5},  # no baseline: not a candidate
    ]
    got = {(r["outtype"], r["temperature"]): (r["n_max"], r["speedup"]) for r in recommend(runs)}
    assert got == {("f32", 0.0): (2, 0.7), ("f32", 1.0): (7, 0.6)}


def test_a_trace_that_leaves_more_than_the_last_token_unstepped_is_an_error():
    """llama.cpp drafts at most the tokens still to come less one, so only the last token may lack a verify
    step; a trace missing lines must fail, never turn into one-token steps that pull tau toward 1."""
    tokens = list(range(11))  # the first from the prefill, then ten
    full = prompt_result({"tokens": tokens, "steps": [[3, 7], [4, 7], [0, 1]]}, 4)
    assert full["accepted"] == [4, 5, 1]
    last = prompt_result({"tokens": tokens, "steps": [[3, 7], [4, 7]]}, 4)
    assert last["accepted"] == [4, 5, 1]  # the last token, undrafted
    with pytest.raises(DflashError, match="prompt line 4: .* verify steps for 4 of the 10 tokens"):
        prompt_result({"tokens": tokens, "steps": [[3, 7]]}, 4, "spec.log")
    plain = prompt_result({"tokens": tokens}, 4, traced=False)  # a server without a drafter
    assert plain["accepted"] == [1] * 10 and plain["tau"] == 1.0


def test_a_request_whose_statistics_never_reach_the_log_is_an_error(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("slot launch_slot_: id  0 | task 0 | processing task\n")
    srv = LlamaServer(tmp_path, tmp_path / "m.gguf", log, draft=tmp_path / "d.gguf")
    with pytest.raises(DflashError, match="no speculative statistics .* per-step trace"):
        srv._request_log(0, wait_s=0.2)
    with open(log, "a") as f:
        f.write("accepted  3/ 7 draft tokens\nstatistics dflash: #calls(b,g,a) = 1 2 0\n")
    assert "accepted" in srv._request_log(0, wait_s=0.2)


class Broken:
    """A loopback HTTP server answering every POST with ``reply``: bytes, and the length it announces."""

    def __init__(self, body: bytes, length: int):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.port = self.httpd.server_address[1]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize(
    "body, length, says",
    [
        (b'{"tokens": [1, 2', 40, "IncompleteRead"),  # the body cut short
        (b"<html>proxy error</html>", 24, "something other than a JSON object"),
        (b"[1, 2, 3]", 9, "something other than a JSON object"),
    ],
)
def test_a_broken_answer_is_one_line(tmp_path, body, length, says):
    (tmp_path / "s.log").write_text("last line of the server\n")
    fake = Broken(body, length)
    srv = LlamaServer(tmp_path, tmp_path / "m.gguf", tmp_path / "s.log")
    srv.port = fake.port
    try:
        with pytest.raises(DflashError, match=says) as e:
            srv.post("/completion", {"prompt": [1]})
    finally:
        fake.close()
    assert len(str(e.value).splitlines()) == 1 and "s.log" in str(e.value)


def test_agreement_leaves_out_each_prompts_final_truncated_step():
    served = [{"line": 1, "tau": 3.0, "tokens": [1] * 11, "accepted": [4, 5, 1]}]
    evald = [{"line": 1, "tau": 3.0, "tokens": [1] * 11, "accepted": [4, 5, 1]}]
    a = agreement(served, evald)
    assert (a["identical_steps"], a["steps"], a["final_steps_excluded"]) == (2, 2, 1)
    truncated = [{"line": 1, "tau": 2.5, "tokens": [1] * 11, "accepted": [4, 3, 3]}]
    assert agreement(truncated, [{**evald[0], "accepted": [4, 3, 1, 1, 1]}])["identical_steps"] == 2
    wrong = agreement([{**served[0], "accepted": [2, 7, 1]}], evald)
    assert wrong["identical_steps"] == 0 and wrong["identical_prompts"] == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--outtype", "f32,q4_k"], "--outtype f32,q4_k: use one or more of f32, f16, bf16, q8_0"),
        (["--compare", "{compare}"], "not a dflash eval report with per-step records"),
        (["--compare", "{missing}"], "cannot read it as JSON"),
    ],
)
def test_bad_eval_arguments_are_refused_before_any_build(tmp_path, monkeypatch, args, says):
    """A wrong --outtype or --compare is one line before llama.cpp is built or a model converted (both can
    take half an hour), and before the drafter is even read."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    compare = tmp_path / "train_metrics.json"
    compare.write_text(json.dumps({"loss": 1.0}))
    args = [a.format(compare=compare, missing=tmp_path / "no.json") for a in args]
    code, out = cli(
        "serve",
        "eval",
        "--drafter",
        tmp_path / "none",
        "--target",
        tmp_path / "none",
        "--prompts",
        tmp_path / "p.jsonl",
        "--out",
        tmp_path / "out",
        *args,
    )
    assert code == 1 and says in out and len(out.strip().splitlines()) == 1, out
    assert "Traceback" not in out and not cache.exists()


def test_signal_names_and_the_cpu_record():
    assert cpu.signal_name(-11) == "SIGSEGV" and cpu.signal_name(-4) == "SIGILL"
    assert cpu.signal_name(0) is None and cpu.signal_name(1) is None and cpu.signal_name(None) is None
    rec = cpu.record()
    assert rec["signature"] == cpu.signature() and len(rec["signature"]) == 10
    assert cpu.lacks(rec) == [] and cpu.lacks({"isa": [*rec["isa"], "avx10_9"]}) == ["avx10_9"]
    assert cpu.signature(("avx2",)) != cpu.signature(("avx2", "avx512f"))
    assert cpu.printed_no_repack("q8_0", "x86_64") and not cpu.printed_no_repack("f32", "x86_64")
    assert not cpu.printed_no_repack("q8_0", "aarch64")
