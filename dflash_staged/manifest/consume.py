"""The checks of the consume transition that every backend shares.

The rule is :meth:`~dflash_staged.manifest.base.Manifest.consume`'s: all or nothing, each job
listed once, only written jobs, each taken by the rank that trained it (or by no one).
:func:`consume_ids` refuses a job listed twice before a backend touches a row; a backend that
finds a job it cannot consume rolls its transaction back with :func:`consume_refused`, which
names each such job and its state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from dflash_staged.manifest.states import Job, ManifestError


def consume_ids(job_ids: Iterable[int]) -> list[int]:
    """The ids of a :meth:`Manifest.consume`; ManifestError if one is listed twice."""
    ids = [int(i) for i in job_ids]
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        raise ManifestError(
            f"cannot consume jobs {twice}: each is listed more than once (two ranks "
            "trained the same shard?); nothing was consumed"
        )
    return ids


def consume_refused(step: int, ids: list[int], jobs: dict[int, Job], rank_of: dict | None) -> ManifestError:
    """The error of a :meth:`Manifest.consume` refused for jobs ``ids`` (``jobs``: their rows)."""

    def why(i: int) -> str:
        j = jobs.get(i)
        if j is None:
            return f"job {i} does not exist"
        taken = f", taken by {j.taken_by!r} rank {j.rank}" if j.taken_by is not None else ""
        told = f" (consumed as rank {rank_of[i]}'s)" if rank_of and rank_of.get(i) is not None else ""
        return f"job {i} is {j.state}{taken}{told}"

    return ManifestError(
        f"step {step} cannot consume: {'; '.join(why(i) for i in ids)}; only written jobs "
        "(taken by the rank that trained them) can be consumed; nothing was consumed"
    )
