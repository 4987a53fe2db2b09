"""What an extract worker reports to its supervisor, on its own status queue (see
:mod:`dflash_staged.extract.supervisor`). The supervisor prints each report once, at the latest
when the run ends; the job states themselves are in the manifest."""

from __future__ import annotations

from typing import NamedTuple


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


Status = WorkerError | JobError
