"""``dflash regenerate --server`` against real ``llama-server`` processes (built from the pinned source by
``dflash serve build``; skipped when it is not built, unless ``DFLASH_REQUIRE_LLAMA_CPP=1``, as ``.ci/run``
sets).

The target is the tiny chat target of ``tests/chat_target.py`` (a Llama whose tokenizer and plain-text chat
template llama.cpp and Hugging Face share), converted to an f32 GGUF by llama.cpp's converter and served
with an f32 KV cache and plain attention, so that both sides decode greedily in the same precision.

Its weights are random, so some greedy steps are near ties. Two kernels that sum in another order (llama.cpp's
and torch's, or torch's AVX2 and AVX-512 ones) can pick either token there, so an answer is held to the
in-process one token for token except where it first departs at a near tie of the target: a step whose top
two logits are closer than :data:`NEAR_TIE` of the logits' spread, far above the kernels' disagreement,
which :func:`test_the_kernels_disagree_far_below_a_near_tie` measures on the CPU the suite runs on
(here, an AMD EPYC: 1.8e-6 of the spread).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from chat_target import save_chat_target

from helpers import ROOT, cli, env

NEW = 24
CONVERSATIONS = 36
NEAR_TIE = 1e-3  # a step whose top-2 logit gap is below this share of the logits' standard deviation


def conversations(n: int = CONVERSATIONS) -> list[dict]:
    """Single and multi-turn conversations, some with a system turn and an old answer to replace."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"tell me about the water number {i}"}]
        if i % 3 == 1:
            msgs = [{"role": "system", "content": "be brief"}, *msgs]
            msgs += [
                {"role": "assistant", "content": "an old answer"},
                {"role": "user", "content": f"why {i}"},
            ]
        out.append({"messages": msgs, "id": i})
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def target(tmp_path_factory, llama_bin):
    from dflash_staged.serve.llamacpp.convert import convert

    root = tmp_path_factory.mktemp("chat")
    tdir = save_chat_target(root / "target")
    prompts = write_jsonl(root / "prompts.jsonl", conversations())
    reference = in_process(tdir, prompts)
    return {
        "root": root,
        "dir": tdir,
        "gguf": convert(tdir, root / "target-f32.gguf", "f32", quiet=True),
        "prompts": prompts,
        "reference": reference,
        "margins": greedy_margins(tdir, reference),
    }


def greedy_margins(target_dir, reference) -> dict:
    """(line, answer index) -> (the target's greedy token ids for that answer, decoded one prompt at a time,
    the stop token included; the relative gap of the top two logits at each of those steps)."""
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_target, load_tokenizer, stop_token_ids
    from dflash_staged.regenerate.worker import render

    tcfg = TargetConfig(model=str(target_dir))
    model, tok = load_target(tcfg, "cpu", layer_ids=[0]).model, load_tokenizer(tcfg)
    stops = stop_token_ids(model, tok)
    out = {}
    for rec in reference:
        msgs = rec["messages"]
        answers = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for k, i in enumerate(answers):
            ids = torch.tensor([render(tok, msgs[:i], ChatOptions())])
            with torch.inference_mode():
                g = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=stops[0],
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            new = g.sequences[0, ids.shape[1] :].tolist()
            rel = []
            for sc in g.scores:
                top = sc[0].topk(2).values
                rel.append(float((top[0] - top[1]) / sc[0].std()))
            out[(rec["regenerated"]["line"], k)] = (new[: len(rel)], rel)
    return out


def departure(tok, ids: list[int], text: str) -> int | None:
    """The first step of ``ids`` whose token takes its decoding off ``text``: None when ``ids`` decode to
    ``text``; the last step (the stop token) when ``text`` goes on where ``ids`` stop."""
    if tok.decode(ids, skip_special_tokens=True).strip() == text:
        return None
    for k in range(len(ids)):
        if not text.startswith(tok.decode(ids[: k + 1], skip_special_tokens=True).strip()):
            return k
    return len(ids) - 1


def in_process(target_dir, prompts) -> list[dict]:
    """The in-process path's records: its worker's ``answer`` on its batches, in this process (a spawned
    worker would give the same records and cost a second interpreter and model load)."""
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_target, load_tokenizer, stop_token_ids
    from dflash_staged.regenerate.command import _batches
    from dflash_staged.regenerate.conversations import read_conversations
    from dflash_staged.regenerate.options import GenOptions
    from dflash_staged.regenerate.worker import answer

    o = GenOptions(
        target=TargetConfig(model=str(target_dir)), out=prompts, devices=["cpu"], max_new_tokens=NEW
    )
    model = load_target(o.target, "cpu", layer_ids=[0]).model
    tok = load_tokenizer(o.target)
    stops = stop_token_ids(model, tok)
    recs = [r for b in _batches(read_conversations(prompts), 16) for r in answer(model, tok, b, o, stops)]
    return sorted(recs, key=lambda r: r["regenerated"]["line"])


def serve(llama_bin, gguf, log, slots: int = 2, extra: tuple = ()):
    from dflash_staged.serve.llamacpp.server import LlamaServer

    return LlamaServer(
        llama_bin, gguf, log, threads=1, kv_type="f32", flash_attn="off", extra=("-np", str(slots), *extra)
    )


def regen(target, out, *args):
    return cli(
        "regenerate",
        "--prompts",
        target["prompts"],
        "--target",
        target["dir"],
        "--out",
        out,
        "--max-new-tokens",
        NEW,
        *args,
    )


def same_answers(got: list[dict], target: dict) -> None:
    """Token for token: the chat API returns text, so the comparison is the text of every answer, its token
    count and its stop (the in-process path decodes its tokens, strips the text and counts the tokens
    before the stop token; the server path the same of the server's). A conversation may depart from the
    in-process one only where the target is at a near tie (module docstring); from there on its turns
    follow another history and are not compared. At most a few may (stated bound: 3 of 36)."""
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_tokenizer

    ref, margins = target["reference"], target["margins"]
    tok = load_tokenizer(TargetConfig(model=str(target["dir"])))
    assert [r["regenerated"]["line"] for r in got] == [r["regenerated"]["line"] for r in ref]
    departed = []
    for a, b in zip(got, ref):
        assert a["id"] == b["id"]
        line = a["regenerated"]["line"]
        if a["messages"] == b["messages"]:
            assert a["regenerated"]["new_tokens"] == b["regenerated"]["new_tokens"]
            assert a["regenerated"]["stop"] == b["regenerated"]["stop"]
            continue
        turns = [(x, y) for x, y in zip(a["messages"], b["messages"]) if y["role"] == "assistant"]
        k = next(i for i, (x, y) in enumerate(turns) if x != y)
        ids, rel = margins[(line, k)]
        steps = [departure(tok, ids, m["content"]) for m in turns[k]]
        at = min(s for s in steps if s is not None)
        assert rel[at] < NEAR_TIE, (line, k, at, rel[at], turns[k])
        departed.append(line)
    assert len(departed) <= 3, departed


# ---------------------------------------------------------------------------------------------- answers
def test_the_kernels_disagree_far_below_a_near_tie(target, llama_bin, tmp_path):
    """What the near-tie tolerance rests on, measured on this CPU: the target's log-probabilities from
    llama-server (f32) and from torch over a greedy continuation differ by less than a tenth of
    :data:`NEAR_TIE` of the logits' spread (measured on an AMD EPYC: 1.2e-5 in log-probability, 1.8e-6 of the
    spread)."""
    from transformers import AutoModelForCausalLM

    prompt = torch.randint(5, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with serve(llama_bin, target["gguf"], tmp_path / "s.log") as s:
        r = s.post(
            "/completion",
            {"prompt": prompt, "n_predict": NEW, "temperature": 0, "n_probs": 8, "return_tokens": True},
        )
    model = AutoModelForCausalLM.from_pretrained(target["dir"], dtype=torch.float32)
    full = torch.tensor(prompt + r["tokens"])
    with torch.inference_mode():
        logits = model(full[None]).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits, -1)
    diffs = [
        abs(t["logprob"] - float(logp[k, t["id"]]))
        for k, step in enumerate(r["completion_probabilities"])
        for t in step["top_logprobs"]
    ]
    assert len(diffs) == 8 * NEW
    spread = float(logits.std(-1).min())
    assert max(diffs) / spread < NEAR_TIE / 10, (max(diffs), spread)


def test_two_servers_answer_greedily_as_the_in_process_path_does(target, llama_bin, tmp_path):
    """A few dozen conversations spread over two servers: every answer equals the in-process path's."""
    ref = target["reference"]
    stops = [s for r in ref for s in r["regenerated"]["stop"]]
    assert 0 < stops.count("eos") < len(stops)  # both ends of an answer are compared
    out = tmp_path / "out.jsonl"
    with (
        serve(llama_bin, target["gguf"], tmp_path / "a.log") as a,
        serve(llama_bin, target["gguf"], tmp_path / "b.log") as b,
    ):
        code, text = regen(target, out, "--server", f"{a.url},{b.url}/v1")
    assert code == 0, text
    same_answers(lines(out), target)
    assert f"{CONVERSATIONS} conversations, 48 answers" in text
    assert "conv/s" in text and "new tok/s" in text and "ETA" in text
    assert "2 at once" in text  # sized to the server's slots
    for log in ("a.log", "b.log"):  # both servers answered
        assert "processing task" in (tmp_path / log).read_text(errors="replace")
    rec = lines(out)[0]["regenerated"]
    assert rec["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": NEW, "seed": 0}
    assert rec["model"] == str(target["gguf"])
    assert not (tmp_path / "out.jsonl.parts").exists()


def parts_lines(out) -> int:
    return sum(len(f.read_text().splitlines()) for f in out.with_name(out.name + ".parts").glob("*.jsonl"))


def wait_for(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def freeze_after_three(out, pgid: int, timeout: float = 60.0) -> None:
    """Wait for three answers in ``out``'s part files, then SIGSTOP the process group ``pgid`` in that same
    poll: a tiny target answers the rest in about a second, less than a kill takes on a busy host."""

    def seen() -> bool:
        if parts_lines(out) < 3:
            return False
        os.killpg(pgid, signal.SIGSTOP)
        return True

    wait_for(seen, timeout, "three answers")


def start_client(target, out, *args) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dflash_staged",
        "regenerate",
        "--prompts",
        str(target["prompts"]),
        "--target",
        str(target["dir"]),
        "--out",
        str(out),
        "--max-new-tokens",
        str(NEW),
        *map(str, args),
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_server_restart_and_a_kill9_of_the_client_lose_nothing(target, llama_bin, tmp_path, monkeypatch):
    """The server is killed mid-run and restarted on its port: the client waits for it and finishes with
    every answer. Then a client is killed (-9) while the server is down: a rerun answers only the rest, and
    the output equals the in-process path's."""
    from dflash_staged.serve.llamacpp import server as llama_server

    port = llama_server.free_port()
    monkeypatch.setattr(llama_server, "free_port", lambda: port)  # every (re)start binds the same port
    srv = serve(llama_bin, target["gguf"], tmp_path / "s.log", slots=1)

    def kill_server():
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    with srv:
        c = start_client(target, first, "--server", srv.url)
        freeze_after_three(first, srv.proc.pid)
        kill_server()
        time.sleep(1.0)  # the client finds the server gone and waits
        assert c.poll() is None and not first.exists()
        srv.__enter__()
        text = c.communicate(timeout=120)[0]
        assert c.returncode == 0, text
        assert "skipped" not in text
        same_answers(lines(first), target)

        c = start_client(target, second, "--server", srv.url)
        freeze_after_three(second, srv.proc.pid)
        kill_server()
        time.sleep(0.5)
        os.killpg(c.pid, signal.SIGKILL)
        c.wait()
        kept = parts_lines(second)
        assert 3 <= kept < CONVERSATIONS and not second.exists()
        srv.__enter__()
        code, text = regen(target, second, "--server", srv.url)
    assert code == 0, text
    assert f"resuming, {kept}/{CONVERSATIONS} conversations already answered" in text
    same_answers(lines(second), target)


def test_a_server_that_dies_for_good_hands_its_work_to_the_other(target, llama_bin, tmp_path):
    a_srv, b_srv = (serve(llama_bin, target["gguf"], tmp_path / f"{n}.log") for n in "ab")
    out = tmp_path / "out.jsonl"
    with a_srv, b_srv:
        c = start_client(target, out, "--server", f"{a_srv.url},{b_srv.url}", "--server-wait", 1)
        wait_for(lambda: parts_lines(out) >= 1, what="a first answer")
        os.killpg(b_srv.proc.pid, signal.SIGKILL)
        text = c.communicate(timeout=120)[0]
    assert c.returncode == 0, text
    assert f"giving up on {b_srv.url}" in text and "skipped" not in text
    same_answers(lines(out), target)


# ---------------------------------------------------------------------------------------------- refusals
def one_line_error(code: int, text: str) -> str:
    assert code == 1 and text.startswith("error: ") and len(text.strip().splitlines()) == 1, text
    return text


def test_servers_that_cannot_be_used_are_refused_before_any_work(target, llama_bin, tmp_path, monkeypatch):
    """Unreachable; serving another model; rendering another chat template; refusing the API key: one line
    each, naming the server, and nothing written. The key itself is never shown."""
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.serve.llamacpp.server import free_port

    out = tmp_path / "out.jsonl"
    text = one_line_error(*regen(target, out, "--server", f"http://127.0.0.1:{free_port()}"))
    assert "cannot use --server http://127.0.0.1:" in text and "Connection refused" in text

    other = convert(
        save_chat_target(tmp_path / "other", seed=1, hidden=96), tmp_path / "o.gguf", "f32", quiet=True
    )
    with serve(llama_bin, other, tmp_path / "o.log") as s:
        text = one_line_error(*regen(target, out, "--server", s.url))
    assert f"{s.url} serves ['{other}'], not the target" in text and "hidden size 96" in text

    tpl = tmp_path / "other.jinja"
    tpl.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    with serve(llama_bin, target["gguf"], tmp_path / "t.log", extra=("--chat-template-file", str(tpl))) as s:
        text = one_line_error(*regen(target, out, "--server", s.url))
    assert f"{s.url} renders the first prompt of line 1 differently from the project: at token" in text
    assert "the server has 'Ass'" in text and "where the project has 'ass'" in text

    secret = "s3cret-key-for-the-test"
    with serve(llama_bin, target["gguf"], tmp_path / "k.log", extra=("--api-key", secret)) as s:
        text = one_line_error(*regen(target, out, "--server", s.url))
        assert "answered 401" in text and "--api-key-env" in text
        monkeypatch.setenv("DFLASH_TEST_KEY", "wrong")
        text = one_line_error(*regen(target, out, "--server", s.url, "--api-key-env", "DFLASH_TEST_KEY"))
        assert "check the key in $DFLASH_TEST_KEY" in text and "wrong" not in text
        monkeypatch.setenv("DFLASH_TEST_KEY", secret)
        code, text = regen(target, out, "--server", s.url, "--api-key-env", "DFLASH_TEST_KEY")
    assert code == 0, text
    assert secret not in text and secret not in out.read_text()
    same_answers(lines(out), target)


def test_a_conversation_the_server_refuses_is_skipped_with_its_line(target, llama_bin, tmp_path):
    """A conversation longer than the server's context is refused (400): it is reported with its line and
    skipped, never written; the run keeps the others and fails, so that a rerun tries it again, unless
    --allow-skipped, which writes the output without it and lists it; a third run has nothing to do."""
    rows = conversations(6)
    rows[3]["messages"][-1]["content"] = "water " * 1500
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = ["--prompts", prompts, "--target", target["dir"], "--out", out, "--max-new-tokens", NEW]
    with serve(llama_bin, target["gguf"], tmp_path / "s.log", extra=("-c", "1024")) as s:
        code, text = cli("regenerate", *args, "--server", s.url)
        assert code == 1, text
        assert "regenerate: line 4 skipped: the server refused it:" in text and "exceeds" in text
        assert "1 of 6 conversations were skipped (lines 4; line 4:" in text and "--allow-skipped" in text
        assert not out.exists() and parts_lines(out) == 5
        code, text = cli("regenerate", *args, "--server", s.url, "--allow-skipped")
        assert code == 0, text
        assert "resuming, 5/6" in text and "1 skipped (lines 4)" in text
    assert [r["regenerated"]["line"] for r in lines(out)] == [1, 2, 3, 5, 6]
    (listed,) = lines(tmp_path / "out.jsonl.skipped.jsonl")
    assert listed["line"] == 4 and "exceeds" in listed["reason"]
    code, text = cli("regenerate", *args, "--server", "http://127.0.0.1:9", "--allow-skipped")
    assert code == 0 and "nothing to do" in text and "1 skipped" in text, text
