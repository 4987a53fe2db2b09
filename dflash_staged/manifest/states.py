"""The job state machine: the contract between ``plan``, ``extract`` and ``train``.

This docstring is the one place it is specified; every backend (:mod:`.sqlite` for one host,
:mod:`.postgres` for many) implements it through the interface of :mod:`.base`, and no code
outside :mod:`dflash_staged.manifest` reads or writes job state.

A manifest holds the plan's immutable samples (token ids and loss masks), its metadata (the
config snapshot, the data hash, epochs, seed, tapped layers) and one row per job: one batch of
one epoch. Job ids are ``epoch * n_batches + pos``: unique across epochs, in manifest order.

Every transition is one transaction::

    pending ──claim──▶ claimed ──publish──▶ written ──consume──▶ consumed ──release──▶ released
       ▲                  │                    │                     │   └──keep (--keep-shards)──▶ kept
       │   lease expired, │                    │ shard failed        │
       ├── owner dead, ◀──┘                    │ verification        │ trainer resumed from a
       │   give back, or                       │ (requeue)           │ checkpoint not covering it
       │   error (< max)                       ▼                     ▼
       └──────────────────────────────────── pending             written
    claimed ──error, errors >= max_attempts──▶ failed (error text kept) ──retry──▶ pending

- **claim** checks the window and claims the next pending job in manifest order (epoch, pos) in
  one transaction, so concurrent workers never overshoot the window or share a job. A claim
  records worker id, host, pid + process start time (pids are reused), a lease deadline and the
  attempt count. An expired lease is reclaimable by anyone; on the same host, a claim whose
  process is gone is reclaimable at once.
- **publish** (``claimed -> written``) records shard bytes and checksum and happens only if the
  publishing attempt still holds the claim; the caller's commit callback (rename the shard into
  place) runs inside that transaction. A worker that lost its claim deletes its own shard.
- **admit** (``take``): a trainer taking a written shard into its buffer sets ``taken_by`` and
  ``rank``; the state stays ``written``.
- **consume** records the trainer rank and optimizer step, when that step completes.
- **release**: the shard was deleted after a durable checkpoint covered the step (``released``),
  or is kept for replay (``kept``). Neither counts against the window.
- **reconcile** on trainer resume: the jobs the checkpoint lists become ``consumed`` (unless
  already released or kept), every other consumed job returns to ``written``, taken marks clear.
- The **window** is the number and bytes of jobs in :data:`IN_WINDOW` (claimed jobs count
  ``real_tokens x bytes_per_token`` bytes once extract has recorded ``bytes_per_token``).
- **extract is done** when no job is in :data:`TO_EXTRACT`; a job returning to ``pending``
  makes it false again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash_staged.errors import DflashError

FORMAT_VERSION = 1
STATES = ("pending", "claimed", "written", "consumed", "released", "kept", "failed")
# Named groups of states: every stage counts by these, never by lists of its own.
TO_EXTRACT = ("pending", "claimed")  # extraction is not finished while any job is here
IN_WINDOW = ("claimed", "written", "consumed")  # held against extract's window
EXTRACTED = ("written", "consumed", "released", "kept")  # a shard was written for it
TRAINED = ("consumed", "released", "kept")  # an optimizer step used it
GROUPS = {"to_extract": TO_EXTRACT, "in_window": IN_WINDOW, "extracted": EXTRACTED, "trained": TRAINED}


class ManifestError(DflashError):
    """The manifest is missing, inconsistent or refuses an operation."""


def plan_it_first(address: str) -> str:
    """The fix for a manifest that does not exist: the ``dflash plan`` that creates it, with the options it
    requires."""
    return f"run `dflash plan --config CONFIG.toml --data DATA --manifest {address}` first"


class NoSuchJobError(ManifestError):
    """The manifest has no job of that id."""


class ManifestMismatchError(ManifestError):
    """An existing manifest was planned from different inputs."""


class TrainerBusyError(ManifestError):
    """Another trainer already consumes this manifest."""


@dataclass
class Job:
    id: int
    epoch: int
    pos: int
    bucket: int
    sample_ids: list[int]
    real_tokens: int
    padded_tokens: int
    state: str
    attempts: int = 0
    worker: str | None = None
    shard_bytes: int | None = None
    checksum: str | None = None
    step: int | None = None
    rank: int | None = None
    taken_by: str | None = None
    host: str | None = None
    pid: int | None = None
    lease_until: float | None = None
    pid_start: int | None = None  # with host and pid: the claiming process (pids are reused)
    boot_id: str | None = None  # the claiming host's boot (PostgreSQL only)

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> Job:
        ids, keys = r["sample_ids"], r.keys()
        return cls(
            id=r["id"],
            epoch=r["epoch"],
            pos=r["pos"],
            bucket=r["bucket"],
            sample_ids=json.loads(ids) if isinstance(ids, str) else list(ids),
            real_tokens=r["real_tokens"],
            padded_tokens=r["padded_tokens"],
            state=r["state"],
            attempts=r["attempts"],
            worker=r["worker"],
            shard_bytes=r["shard_bytes"],
            checksum=r["checksum"],
            step=r["step"],
            rank=r["rank"],
            taken_by=r["taken_by"],
            host=r["host"],
            pid=r["pid"],
            lease_until=r["lease_until"],
            pid_start=r["pid_start"] if "pid_start" in keys else None,
            boot_id=r["boot_id"] if "boot_id" in keys else None,
        )


@dataclass
class ClaimResult:
    job: Job | None
    window_full: bool = False
    window: dict | None = None
    nothing_left: bool = False


@dataclass
class Proc:
    """A registered extract or train process."""

    id: str
    role: str
    host: str
    pid: int
    pid_start: int | None
    group_id: str | None
    rank: int | None
    info: dict
    heartbeat: float | None = None  # last heartbeat (the manifest's clock), where the backend keeps one

    @classmethod
    def from_row(cls, p: Mapping[str, Any], heartbeat: float | None = None) -> Proc:
        """A row of a backend's ``procs`` table (``info`` as JSON text)."""
        return cls(
            id=p["id"],
            role=p["role"],
            host=p["host"],
            pid=p["pid"],
            pid_start=p["pid_start"],
            group_id=p["group_id"],
            rank=p["rank"],
            info=json.loads(p["info"] or "{}"),
            heartbeat=heartbeat,
        )


def check_format_version(version, where) -> None:
    """ManifestError unless a manifest's recorded ``format_version`` is the one this code reads."""
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{where} has manifest format_version {version}; this dflash-staged reads version "
            f"{FORMAT_VERSION}: re-plan it with this version (or use the version that wrote it)"
        )


def group_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """Jobs per named group (:data:`GROUPS`) from jobs per state."""
    return {name: sum(counts.get(s, 0) for s in states) for name, states in GROUPS.items()}


def diff_dicts(a: Any, b: Any, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf where two nested dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff_dicts(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def plan_identity(config: dict, data_hash: str, epochs: int, seed: int) -> dict:
    """What makes two plans the same plan: the config, the data's hash, epochs and seed."""
    return {"config": config, "data_hash": data_hash, "epochs": int(epochs), "seed": int(seed)}
