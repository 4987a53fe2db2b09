"""A real ``llama-server`` on loopback, started and stopped by this process, and its HTTP API.

Contract:

* **Start.** :class:`LlamaServer` (a context manager) takes a free loopback port, starts the
  server in a session of its own with ``LLAMA_TRACE=1`` and log verbosity 4 (one log line per verify
  step: ``accepted a/n draft tokens``; the speculative statistics after each request) and the death
  signal of this process (Linux ``PR_SET_PDEATHSIG``), and returns once ``GET /health`` answers 200.
  A server that exits before it is ready, or that is not ready within ``ready_timeout_s``, raises one
  line quoting its log's last line, naming the signal that killed it (``SIGSEGV``, ``SIGILL``: then the
  CPU the build was made for, :mod:`.cpu`); a port taken between the probe and the bind is retried on
  another port.
* **Weight repacking.** llama.cpp repacks weights for its CPU kernels while it loads them (on an AMX host
  the AMX buffer type takes q8_0 and the k-quants), and that repacking crashes on some hosts (llama.cpp
  #20824). A server killed by SIGSEGV, SIGBUS or SIGABRT before it is ready is started once
  more with ``--no-repack``, said in one line (``say``); :attr:`LlamaServer.repack` then reads
  ``off after SIGSEGV while loading`` instead of ``on`` (``off`` when ``repack=False`` was asked), for the
  reports. On an x86 host without AMX ``--no-repack`` changes nothing for this project's outtypes (f32,
  f16, bf16, q8_0: llama.cpp repacks none of them there).
* **Stop.** On every exit path of the ``with`` block (an error, Ctrl-C, a normal end) the server's
  process group gets SIGTERM, then SIGKILL after 5 s; if this process is killed, the kernel sends the
  server SIGKILL. Its log (``log``) is kept.
* **Speculative decoding** with a DFlash-family drafter: ``--spec-type draft-dflash`` (DFlash and
  DFlash2) or ``draft-dspark``, ``--spec-draft-n-max n`` (llama.cpp clamps it to the block: ``B - 1``
  for DFlash, ``B`` for DSpark's anchor-first block), ``--spec-draft-p-min 0`` (every draft is verified,
  as ``dflash eval`` does) and the same threads for the drafter as for the target. ``kv_type`` sets
  both models' KV cache type and ``flash_attn`` their attention kernel (llama.cpp's defaults: f16 and
  ``auto``, which on a CPU is its flash-attention kernel; that kernel is less precise than plain
  attention even with an f32 cache: a drafter's logits move by about 1e-3 of their scale). ``f32`` and
  ``off`` make an f32 model compute in f32 end to end, which an exact comparison with ``dflash eval``
  needs. A target that cannot remove rejected positions (``restore checkpoint`` in the log) re-verifies
  them; those lines are not steps.
* :meth:`LlamaServer.complete` posts token ids to ``/completion`` (no prompt cache, so each prompt
  starts cold) and returns the response with, on a server with a drafter, ``steps``: the accepted drafts
  of each verify step, read from the log lines the request produced, and ``draft_calls`` and
  ``draft_ms``: the request's drafting calls and their time, from llama.cpp's speculative statistics
  (which count since the start). A request whose statistics do not reach the log within 10 s raises one
  line (the trace is missing: its steps would be wrong, never silently short).
* **Answers.** An HTTP error, a connection that breaks or a body cut short (``IncompleteRead``), and a
  body that is not a JSON object each raise one line naming the path and the log.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.procs import die_with_parent
from dflash_staged.serve.llamacpp import cpu

DRAFT_TIME = re.compile(r"#calls\(b,g,a\) =\s+\d+\s+(\d+).*dur\(b,g,a\) = [\d.]+, ([\d.]+), [\d.]+ ms")
ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens\s*$", re.M)
REPACK_CRASHES = ("SIGSEGV", "SIGBUS", "SIGABRT")  # a load killed by one is retried without repacking


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_us() -> None:  # between fork and exec
    os.setsid()
    die_with_parent(signal.SIGKILL)


class LlamaServer:
    def __init__(
        self,
        bin_dir: Path,
        model: Path,
        log: Path,
        draft: Path | None = None,
        spec_type: str | None = None,
        n_max: int | None = None,
        threads: int | None = None,
        ctx_size: int = 4096,
        kv_type: str | None = None,
        flash_attn: str | None = None,
        ready_timeout_s: float = 300.0,
        extra: tuple[str, ...] = (),
        gpu: bool = False,
        repack: bool = True,
        say: Callable[[str], None] | None = None,
    ):
        self.bin_dir, self.model, self.log, self.draft = Path(bin_dir), Path(model), Path(log), draft
        self.spec_type, self.n_max, self.threads, self.ctx_size = spec_type, n_max, threads, ctx_size
        self.ready_timeout_s, self.extra, self.kv_type = ready_timeout_s, extra, kv_type
        self.flash_attn, self.gpu = flash_attn, gpu
        self.repack = "on" if repack and "--no-repack" not in extra else "off"
        self.say = say or (lambda msg: print(f"llama.cpp: {msg}", file=sys.stderr, flush=True))
        self.proc: subprocess.Popen | None = None
        self._drafts = (0, 0.0)  # the drafter's calls and ms llama.cpp had counted after the last request
        self.port = 0

    def command(self, port: int) -> list[str]:
        cmd = [str(self.bin_dir / "llama-server"), "-m", str(self.model), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "-c", str(self.ctx_size), "-np", "1", "--no-webui", "-lv", "4"]
        if self.threads:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.kv_type:
            cmd += ["-ctk", self.kv_type, "-ctv", self.kv_type]
        if self.flash_attn:
            cmd += ["-fa", self.flash_attn]
        if self.gpu:  # a CUDA build: every layer of both models on the GPU
            cmd += ["-ngl", "999"] + (["-ngld", "999"] if self.draft is not None else [])
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", self.spec_type or "draft-dflash"]
            cmd += ["--spec-draft-p-min", "0", "--spec-draft-n-min", "0"]
            if self.n_max is not None:
                cmd += ["--spec-draft-n-max", str(self.n_max)]
            if self.threads:
                cmd += ["-td", str(self.threads), "-tbd", str(self.threads)]
            if self.kv_type:
                cmd += ["-ctkd", self.kv_type, "-ctvd", self.kv_type]
        if self.repack != "on" and "--no-repack" not in self.extra:
            cmd += ["--no-repack"]
        return cmd + list(self.extra)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"

    def _start_once(self) -> bool | str:
        """True when ready; False when the port was taken (try another); the signal's name when it was
        killed by one before it was ready; raises otherwise."""
        self.port, self._drafts = free_port(), (0, 0.0)
        env = {**os.environ, "LLAMA_TRACE": "1"}
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.bin_dir), env.get("LD_LIBRARY_PATH")])
        )
        with open(self.log, "ab") as out:
            out.write(f"$ {' '.join(self.command(self.port))}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.command(self.port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_us,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._log_tail()
                if "bind" in tail.lower() or "address already in use" in tail.lower():
                    return False
                sig = cpu.signal_name(self.proc.returncode)
                if sig:
                    return sig
                raise DflashError(
                    f"llama-server exited (code {self.proc.returncode}) before it was ready: {tail} "
                    f"(full log: {self.log})"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise DflashError(
            f"llama-server was not ready within {self.ready_timeout_s:.0f} s: {self._log_tail()} "
            f"(full log: {self.log})"
        )

    def __enter__(self) -> LlamaServer:
        if not (self.bin_dir / "llama-server").is_file():
            raise DflashError(f"{self.bin_dir}/llama-server does not exist; run `dflash serve build` first")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            tries = 0
            while tries < 3:
                got = self._start_once()
                if got is True:
                    return self
                self.stop()
                if got is False:  # the port was taken
                    tries += 1
                elif got in REPACK_CRASHES and self.repack == "on":
                    self.repack = f"off after {got} while loading"
                    self.say(
                        f"llama-server was killed by {got} while loading {self.model.name} with weight "
                        "repacking (a crash of llama.cpp's repacking on this CPU, llama.cpp #20824); "
                        "starting it once more with --no-repack"
                    )
                else:
                    raise DflashError(self._killed(got))
            raise DflashError(f"llama-server could not bind a loopback port three times (log: {self.log})")
        except BaseException:
            self.stop()
            raise

    def _killed(self, sig: str) -> str:
        """The line for a server killed by ``sig`` before it was ready."""
        msg = f"llama-server was killed by {sig} before it was ready"
        if sig == "SIGILL":
            from dflash_staged.serve.llamacpp.build import built_for

            rec = built_for(self.bin_dir.parent) or {}
            missing = cpu.lacks(rec) if rec else []
            made = f"made for {rec.get('model', 'an unknown CPU')}" + (
                f", whose {', '.join(missing)} this host lacks" if missing else ""
            )
            msg += (
                f" (an illegal instruction: the build in {self.bin_dir.parent} was {made}); run "
                "`dflash serve build` on this host for a build of its own"
            )
        elif sig in REPACK_CRASHES and self.repack != "on":
            msg += " even with --no-repack"
        return f"{msg}: {self._log_tail()} (full log: {self.log})"

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                p.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def post(self, path: str, body: dict, timeout: float = 3600.0) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            try:
                detail = e.read().decode(errors="replace")[:300]
            except (OSError, http.client.HTTPException):
                detail = e.reason
            raise DflashError(
                f"llama-server answered {e.code} to {path}: {detail} (log: {self.log})"
            ) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            alive = self.proc is not None and self.proc.poll() is None
            how = "did not answer" if alive else "died"
            sig = None if alive or self.proc is None else cpu.signal_name(self.proc.returncode)
            how += f" (killed by {sig})" if sig else ""
            raise DflashError(
                f"llama-server {how} on {path} ({type(e).__name__}: {e}); {self._log_tail()} "
                f"(log: {self.log})"
            ) from None
        try:
            out = json.loads(raw)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise DflashError(
                f"llama-server answered {path} with something other than a JSON object ({raw[:80]!r}) "
                f"(log: {self.log})"
            )
        return out

    def _request_log(self, start: int, wait_s: float = 10.0) -> str:
        """The log written since ``start``, once it holds the request's speculative statistics (its last
        line): llama.cpp logs from a thread of its own, so its lines can land after the response. Raises
        when they do not come within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            with open(self.log, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            if "statistics" in text:
                return text
            if time.monotonic() > deadline:
                raise DflashError(
                    f"llama-server logged no speculative statistics for the request within {wait_s:.0f} s "
                    f"(log: {self.log}): its per-step trace (LLAMA_TRACE=1, -lv 4) is missing, so the "
                    "request's verify steps are unknown; check that the build is this project's "
                    "(dflash serve build) and that nothing rotates or truncates the log"
                )
            time.sleep(0.02)

    def complete(
        self,
        ids: list[int],
        n_predict: int,
        temperature: float = 0.0,
        seed: int = 0,
        top_p: float = 1.0,
        top_k: int = 0,
        cache_prompt: bool = False,
    ) -> dict:
        """One prompt (token ids); the response plus ``steps`` (see the module docstring).
        ``cache_prompt``: reuse the KV cache of the previous prompt's common prefix (timing a batch)."""
        start = self.log.stat().st_size
        body = {
            "prompt": list(ids),
            "n_predict": n_predict,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": 0.0,
            "seed": seed,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "stream": False,
        }
        r = self.post("/completion", body)
        if self.draft is None:
            return r
        text = self._request_log(start)
        r["steps"] = [[int(a), int(n)] for a, n in ACCEPTED.findall(text)]
        stats = DRAFT_TIME.findall(text)
        if stats:  # llama.cpp's own timer of the drafter's calls, cumulative over the server's life
            now = (int(stats[-1][0]), float(stats[-1][1]))
            r["draft_calls"], r["draft_ms"] = now[0] - self._drafts[0], round(now[1] - self._drafts[1], 3)
            self._drafts = now
        return r
