"""What an extract worker reports to its supervisor, on its own status queue (see
:mod:`dflash_staged.extract.supervisor`). The supervisor prints each report once, at the latest
when the run ends; the job states themselves are in the manifest. A worker also sends its busy and
idle seconds (:class:`Seconds`, kept by :class:`Stopwatch`; the kinds are those of
:mod:`dflash_staged.manifest.balance`), which the supervisor sums and publishes."""

from __future__ import annotations

import time
from typing import NamedTuple

from dflash_staged.manifest.balance import SIDES

REPORT_S = 1.0  # how often a worker sends its seconds (at most; and once when its loop ends)


class WorkerError(NamedTuple):
    """The worker stopped on an error (every rank of a group may report the same one)."""

    who: int | str  # the worker's index, or "INDEX rank R" for a tensor-parallel follower
    text: str  # the message of a DflashError, else the traceback

    def line(self) -> str:
        return f"worker {self.who}: {self.text}"


class JobError(NamedTuple):
    """A job failed; the worker goes on."""

    worker: int
    job: int
    error: str
    state: str  # where the job went: back to pending, or failed (after extract.max_attempts errors)

    def line(self) -> str:
        return f"worker {self.worker}: job {self.job} failed ({self.error}); now {self.state}"


class Seconds(NamedTuple):
    """A worker's cumulative seconds per kind since its loop began (``SIDES["extract"]``)."""

    worker: int
    seconds: dict


Status = WorkerError | JobError


class Stopwatch:
    """Charges the time since the previous :meth:`lap` to :attr:`kind` (what that time turned out to
    be; None: nothing), and sends the totals as :class:`Seconds` at most every :data:`REPORT_S` (and
    whenever ``send``)."""

    def __init__(self, worker: int, status_q):
        self.worker, self.q = worker, status_q
        self.seconds = dict.fromkeys(SIDES["extract"], 0.0)
        self.kind: str | None = None
        self.mark = self.sent = time.monotonic()

    def lap(self, send: bool = False) -> None:
        now = time.monotonic()
        if self.kind is not None:
            self.seconds[self.kind] += now - self.mark
        self.mark = now
        if send or now - self.sent >= REPORT_S:
            self.q.put(Seconds(self.worker, dict(self.seconds)))
            self.sent = now

    def going(self, keep_going) -> bool:
        """``keep_going()``, after a lap (sent when it is false: the loop ends)."""
        go = keep_going()
        self.lap(send=not go)
        return go
