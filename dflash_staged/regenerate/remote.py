"""``dflash regenerate --server``: the conversations answered through OpenAI-compatible servers.

Contract:

* **Spread.** Each server gets as many threads as it takes conversations at once (``Served.concurrency``);
  every thread takes the next conversation from one shared queue (a faster server takes more) and answers
  all of its turns on its own server, whose prefix cache then holds the conversation's history. Each user
  turn is one chat completion of the history so far, rendered by the server as the in-process path renders
  it (checked before the run: :mod:`~dflash_staged.regenerate.checks`): the system and user turns as they
  are, each earlier answer as the server gave it (with its reasoning field), the chat options as
  ``chat_template_kwargs``, and the sampling settings: ``temperature``, ``top_p``, ``top_k`` (-1: off),
  ``min_p`` 0 (llama-server's default is not), ``max_tokens``, and at ``temperature > 0`` a ``seed`` per
  conversation and turn. An answer is stored in the project's one shape for reasoning
  (:func:`~dflash_staged.chat.assistant_message`): a server's separate reasoning field, or the reasoning a
  server without a reasoning parser leaves in the content before ``</think>``, becomes
  ``reasoning_content`` (the name chat templates such as Qwen3's read back), the rest ``content``; the
  in-process path stores the same shape.
* **Durable.** A conversation is appended to this run's part file (:mod:`~dflash_staged.regenerate.parts`)
  and fsynced as soon as its last turn is answered, so a ``kill -9`` loses only the conversations in flight,
  and a rerun answers only the others. A conversation is written whole or not at all.
* **Failures.** A request that fails with a retryable kind (:mod:`~dflash_staged.regenerate.client`) is
  tried again after :func:`~dflash_staged.regenerate.client.backoff`, at most ``max_attempts`` times. A
  server that refuses connections or answers 503 is unavailable (restarting, loading): its threads wait for
  it, polling with backoff, without spending attempts, for ``server_wait_s`` after it stopped answering; then
  the server is given up and its conversations go back to the queue for the other servers (the run stops,
  keeping what is answered, when none is left). A conversation refused by the server (another 4xx, e.g.
  longer than its context) or still failing after ``max_attempts`` is skipped: one line on stderr with its
  input line number. 401, 403 and 404 stop the run (the key or the model is wrong for every conversation).
* **Signals.** SIGINT and SIGTERM stop the run at once; the answered conversations are in the part file.
* **Bugs.** Any other exception in a thread stops the run (the answered conversations are kept) and is
  raised again from :meth:`RemoteRun.run` with its own traceback, which the error boundary shows in full
  (:mod:`dflash_staged.errors`): only the failures above are one-line errors.
"""

from __future__ import annotations

import collections
import random
import signal
import threading
import time

import click

from dflash_staged.chat import assistant_message
from dflash_staged.children import Progress
from dflash_staged.regenerate.checks import Served
from dflash_staged.regenerate.client import RETRY, Reply, RequestFailed, backoff
from dflash_staged.regenerate.conversations import Conversation
from dflash_staged.regenerate.options import GenOptions, ServerOptions
from dflash_staged.regenerate.parts import PartWriter
from dflash_staged.regenerate.report import progress_line

POLL_S = 0.2
DOWN_POLL_CAP_S = 5.0  # a server being waited for is polled at least this often


class _Skip(Exception):
    """This conversation cannot be answered (the reason is the message)."""


class _Gone(Exception):
    """This thread's server did not come back within ``server_wait_s``."""


class _Fatal(Exception):
    """No conversation can be answered (the message says why)."""


class Outcome:
    def __init__(self):
        self.answered, self.tokens = 0, 0
        self.skipped: dict[int, str] = {}
        self.fatal: str | None = None
        self.signalled = False
        self.gone: dict[str, str] = {}  # server url -> the failure it was given up on
        self.left = 0  # conversations nobody could answer (every server was given up)
        self.bug: BaseException | None = None  # an unexpected error in a thread, raised again by run()


class RemoteRun:
    def __init__(self, todo: list[Conversation], o: GenOptions, s: ServerOptions, servers: list[Served]):
        self.o, self.s, self.servers = o, s, servers
        self.queue = collections.deque(todo)
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()  # the part file's appends (each fsynced) and its close
        self.stop = threading.Event()
        self.in_flight = 0
        self.down_since: dict[str, float | None] = {sv.ep.url: None for sv in servers}
        self.result = Outcome()
        self.writer: PartWriter | None = PartWriter(o.out, 0)

    # ------------------------------------------------------------------ the queue
    def _take(self, sv: Served) -> Conversation | None:
        """The next conversation, None when this thread should stop; waits while others may give some back."""
        while not self.stop.is_set() and sv.ep.url not in self.result.gone:
            with self.lock:
                if self.queue:
                    self.in_flight += 1
                    return self.queue.popleft()
                if not self.in_flight:
                    return None
            self.stop.wait(POLL_S)
        return None

    def _settle(self, conv: Conversation, rec: dict | None = None, skip: str | None = None) -> None:
        """``conv`` answered (``rec``, appended), skipped (``skip``: why) or given back (neither). Appends
        take their own lock (an fsync never holds up ``_take``); the first failed append (a full disk)
        closes the part file, so no later line lands after a torn one, and stops the run."""
        if rec is not None:
            with self.write_lock:
                try:
                    if self.writer is None:  # the run is over: the answer is dropped, the rerun asks again
                        rec = None
                    else:
                        self.writer.append([rec])
                except OSError as e:
                    path = self.writer.path
                    self.writer.close()
                    self.writer, rec = None, None
                    self._fail(f"cannot append an answer to {path} ({e.strerror}); free space and rerun")
        with self.lock:
            if rec is not None:
                self.result.answered += 1
                self.result.tokens += sum(rec["regenerated"]["new_tokens"])
            elif skip is not None:
                self.result.skipped[conv.line] = skip
                click.echo(f"regenerate: line {conv.line} skipped: {skip}", err=True)
            else:
                self.queue.appendleft(conv)
            self.in_flight -= 1

    def _fail(self, why: str) -> None:
        with self.lock:
            self.result.fatal = self.result.fatal or why
        self.stop.set()

    # ------------------------------------------------------------------ one thread
    def _thread(self, sv: Served) -> None:
        rng = random.Random()
        while (conv := self._take(sv)) is not None:
            try:
                rec = self._answer(sv, conv, rng)
                if rec is None:  # the run stopped mid-conversation
                    self._settle(conv)
                    return
                self._settle(conv, rec)
            except _Skip as e:
                self._settle(conv, skip=str(e))
            except _Gone as e:
                with self.lock:
                    if sv.ep.url not in self.result.gone:
                        self.result.gone[sv.ep.url] = str(e)
                        click.echo(
                            f"regenerate: giving up on {sv.ep.url} ({e}); the others take its work", err=True
                        )
                self._settle(conv)
                return
            except _Fatal as e:
                self._fail(str(e))
                self._settle(conv)
                return
            except OSError as e:  # the part file could not be written
                self._fail(f"cannot append to {self.o.out.name}.parts: {e}")
                self._settle(conv)
                return
            except BaseException as e:  # noqa: BLE001 - a bug: stop the run, then raise it in the main thread
                with self.lock:
                    self.result.bug = self.result.bug or e
                self.stop.set()
                self._settle(conv)
                return

    def _answer(self, sv: Served, conv: Conversation, rng: random.Random) -> dict | None:
        hist: list[dict] = []
        stops: list[str] = []
        lens: list[int] = []
        for turn in conv.turns:
            hist.append(dict(turn))
            if turn["role"] != "user":
                continue
            reply = self._request(sv, self._body(sv, hist, conv.line, len(lens)), rng)
            if reply is None:
                return None
            hist.append(assistant_message(reply.content, reply.reasoning))
            stops.append(reply.stop)
            lens.append(reply.new_tokens)
        meta = {"line": conv.line, "stop": stops, "new_tokens": lens}
        meta.update(model=sv.model, sampling=self.o.sampling())
        return {**conv.extra, "messages": hist, "regenerated": meta}

    def _body(self, sv: Served, hist: list[dict], line: int, turn: int) -> dict:
        o = self.o
        body = {
            "model": sv.model,
            "messages": hist,
            "max_tokens": o.max_new_tokens,
            "temperature": o.temperature,
            "top_p": o.top_p,
            "top_k": o.top_k if o.top_k > 0 else -1,
            "min_p": 0.0,
            "stream": False,
        }
        if o.temperature > 0:
            body["seed"] = (o.seed * 1_000_003 + line * 131 + turn) % 2**31
        if o.chat.kwargs:
            body["chat_template_kwargs"] = o.chat.kwargs
        return body

    def _request(self, sv: Served, body: dict, rng: random.Random) -> Reply | None:
        """The server's answer (see the module docstring for the retries); None when the run stops."""
        attempts = waits = 0
        while not self.stop.is_set():
            try:
                reply = sv.ep.chat(body)
            except RequestFailed as e:
                if e.kind in ("auth", "missing"):
                    raise _Fatal(str(e)) from None
                if e.kind == "down":
                    with self.lock:
                        since = self.down_since[sv.ep.url] = self.down_since[sv.ep.url] or time.monotonic()
                    if time.monotonic() - since > self.s.server_wait_s:
                        raise _Gone(f"{e} (for {self.s.server_wait_s:.0f} s)") from None
                    waits += 1
                    self.stop.wait(min(DOWN_POLL_CAP_S, backoff(waits, None, rng)))
                    continue
                if e.kind not in RETRY:
                    raise _Skip(f"the server refused it: {e}") from None
                attempts += 1
                if attempts >= self.s.max_attempts:
                    raise _Skip(f"{attempts} attempts failed, the last: {e}") from None
                self.stop.wait(backoff(attempts, e.retry_after, rng))
                continue
            with self.lock:
                self.down_since[sv.ep.url] = None
            return reply
        return None

    # ------------------------------------------------------------------ the run
    def run(self, total: int, already: int) -> Outcome:
        threads = [
            threading.Thread(target=self._thread, args=(sv,), name=f"regenerate-{sv.ep.url}-{i}", daemon=True)
            for sv in self.servers
            for i in range(min(sv.concurrency, len(self.queue)))
        ]
        progress = Progress("regenerate", total)
        old = {}

        def on_signal(*_):
            self.result.signalled = True
            self.stop.set()

        if threading.current_thread() is threading.main_thread():
            old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        t0 = time.monotonic()
        try:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads) and not self.stop.is_set():
                time.sleep(POLL_S)
                r = self.result
                progress.show(
                    already + r.answered,
                    progress_line(already + r.answered, total, r.answered, r.tokens, time.monotonic() - t0),
                )
        finally:
            self.stop.set()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            with self.write_lock:  # threads still in a request find the writer closed and drop their answer
                if self.writer is not None:
                    self.writer.close()
                    self.writer = None
            with self.lock:
                self.result.left = len(self.queue) + self.in_flight
        if self.result.bug is not None:  # a bug, not a user's error: its own traceback, in full
            raise self.result.bug
        return self.result


def run_remote(todo: list[Conversation], o: GenOptions, s: ServerOptions, servers, total: int, already: int):
    """Answer ``todo`` through ``servers`` (checked by :func:`~dflash_staged.regenerate.checks.connect`);
    returns the :class:`Outcome`."""
    return RemoteRun(todo, o, s, servers).run(total, already)
