"""The manifest interface: every operation the stages need, over one backend or another.

:class:`Manifest` is what ``plan``, ``extract``, ``train``, ``eval``, ``status`` and the
launchers hold. ``Manifest.open(address)`` and ``Manifest.create(address, ...)`` pick the
backend from the address among those registered (:func:`register_backend`; a directory:
:class:`~dflash_staged.manifest.sqlite.SqliteManifest`).
The job state machine these operations implement is specified in
:mod:`dflash_staged.manifest.states`. A handle belongs to one process and one thread.

A backend implements the abstract operations below; the queries built on them (counts, progress,
``status``, hosts) are shared (:class:`~dflash_staged.manifest.queries.SharedQueries`), and so are
the consume checks (:mod:`.consume`).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dflash_staged.config import Config, config_from_dict
from dflash_staged.manifest.queries import SharedQueries
from dflash_staged.manifest.states import (
    STATES,
    ClaimResult,
    Job,
    ManifestError,
    ManifestMismatchError,
    Proc,
    diff_dicts,
    plan_identity,
)

_BACKENDS: list[type[Manifest]] = []  # registered by each backend module (see register_backend)


def register_backend(cls: type[Manifest]) -> type[Manifest]:
    """Class decorator: make a backend reachable through ``Manifest.open``/``create``. Backends are
    asked in the order they registered, except that one whose :attr:`~Manifest.CATCH_ALL` is true
    (the embedded SQLite backend, which takes any path) is asked last, whatever the import order."""
    _BACKENDS.append(cls)
    _BACKENDS.sort(key=lambda c: c.CATCH_ALL)  # stable: the others keep their order
    return cls


def _backend(address: str | Path) -> type[Manifest]:
    for cls in _BACKENDS:
        if cls.handles(address):
            return cls
    raise ManifestError(f"no manifest backend takes the address {address!r}")  # pragma: no cover


class Manifest(SharedQueries, abc.ABC):
    """A handle on one manifest; see the module docstring."""

    address: str  # how the user named it (a directory path); used in messages
    CATCH_ALL: ClassVar[bool] = False  # whether this backend takes any address (asked last)

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def open(cls, address: str | Path, readonly: bool = False) -> Manifest:
        """Open an existing manifest; ManifestError (naming the fix) if there is none."""
        return _backend(address)._open(address, readonly)

    @classmethod
    def create(
        cls,
        address: str | Path,
        *,
        config: Config,
        samples,
        plan,
        data_path: str,
        data_hash: str,
        layer_ids: list[int] | None = None,
        extra_meta: dict | None = None,
    ) -> Manifest:
        """Create the manifest atomically; a no-op if it exists holding the same plan.

        Raises ManifestMismatchError naming the differences if it exists with another plan.
        """
        backend = _backend(address)
        wanted = plan_identity(config.to_dict(), data_hash, plan.epochs, plan.seed)
        if backend._exists(address):
            m = backend._open(address, False)
            try:
                m.check_same_plan(wanted)
            except BaseException:
                m.close()
                raise
            return m
        backend._write_new(
            address,
            config=config,
            samples=samples,
            plan=plan,
            data_path=data_path,
            data_hash=data_hash,
            layer_ids=layer_ids,
            extra_meta=extra_meta,
        )
        return backend._open(address, False)

    @classmethod
    def exists(cls, address: str | Path) -> bool:
        """Whether a manifest is at ``address``."""
        return _backend(address)._exists(address)

    @classmethod
    @abc.abstractmethod
    def handles(cls, address: str | Path) -> bool:
        """Whether this backend takes ``address``."""

    @classmethod
    @abc.abstractmethod
    def _exists(cls, address) -> bool: ...

    @classmethod
    @abc.abstractmethod
    def _write_new(cls, address, **plan_kw) -> None:
        """Create the manifest of a plan atomically (see :meth:`create`)."""

    @classmethod
    @abc.abstractmethod
    def _open(cls, address, readonly: bool) -> Manifest: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ metadata and samples
    @property
    @abc.abstractmethod
    def meta(self) -> dict[str, Any]:
        """The plan's metadata (``config``, ``data_hash``, ``epochs``, ``seed``, ``layer_ids``, ...)."""

    @abc.abstractmethod
    def set_meta(self, key: str, value: Any) -> None:
        """Set one metadata key (extract records ``bytes_per_token``, ``layer_ids``, ``extract_window``)."""

    def forget_meta(self) -> None:
        """Read :attr:`meta` afresh next time (another process may have set a key since)."""
        self._meta = None

    @abc.abstractmethod
    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int32) and loss mask (uint8) of sample i."""

    @abc.abstractmethod
    def sample_lengths(self) -> np.ndarray: ...

    @property
    def config(self) -> Config:
        return config_from_dict(self.meta["config"], f"{self.address} (config snapshot)")

    @property
    def manifest_id(self) -> str:
        return self.meta["manifest_id"]

    def check_same_plan(self, wanted: dict) -> None:
        """Raise ManifestMismatchError unless this manifest holds the plan ``wanted``
        (:func:`~dflash_staged.manifest.states.plan_identity`)."""
        m = self.meta
        defaults = Config().to_dict()  # a key the config gained since this plan reads as its default
        snapshot = {
            k: {**defaults.get(k, {}), **v} if isinstance(v, dict) else v for k, v in m["config"].items()
        }
        have = plan_identity(snapshot, m["data_hash"], m["epochs"], m["seed"])
        diffs = diff_dicts(have, wanted)
        if diffs:
            raise ManifestMismatchError(
                f"{self.address} was planned from different inputs ({'; '.join(diffs[:8])}"
                f"{'; ...' if len(diffs) > 8 else ''}); use another manifest, or delete {self.address} "
                "to re-plan"
            )

    # ------------------------------------------------------------------ queries
    @abc.abstractmethod
    def job(self, job_id: int) -> Job: ...

    @abc.abstractmethod
    def jobs(self, state: str | None = None) -> list[Job]:
        """Every job (or those in ``state``), in id order."""

    @abc.abstractmethod
    def _query(self, sql: str) -> Iterable[Any]:
        """The rows (mappings) of one read-only SQL query without parameters."""

    @abc.abstractmethod
    def window(self, node: str | None = None) -> dict[str, int]:
        """``{"shards": n, "bytes": b}`` held in the window (see the state machine); with ``node``,
        of the jobs that node claimed or holds (a node-local store, :mod:`.layout`)."""

    @abc.abstractmethod
    def ready_count(self, node: str | None = None) -> int:
        """Written jobs no trainer has taken yet (with ``node``: held by that node)."""

    @abc.abstractmethod
    def consumed_upto(self, step: int) -> list[Job]:
        """Consumed jobs whose step is at most ``step`` (a checkpoint at ``step`` covers them)."""

    @abc.abstractmethod
    def events(self, kind: str | None = None) -> list[dict]: ...

    @abc.abstractmethod
    def requeue_reasons(self) -> dict[str, int]:
        """How often shards were sent back for re-extraction, by kind of error."""

    def now(self) -> float:
        """The manifest's clock, in which leases and heartbeats are kept (this host's, or the server's)."""
        return time.time()

    @abc.abstractmethod
    def failed_errors(self) -> list[tuple[Job, str]]:
        """Failed jobs with their last error text."""

    # ------------------------------------------------------------------ extract side
    @abc.abstractmethod
    def reclaim_stale(self) -> int:
        """Claims whose lease expired, or whose process is gone (same host), back to pending."""

    @abc.abstractmethod
    def claim(
        self,
        worker: str,
        *,
        window: int,
        window_bytes: int = 0,
        lease_s: float = 300.0,
        node: str | None = None,
    ) -> ClaimResult:
        """Check the window and claim the next pending job in manifest order, in one transaction;
        with ``node``, the window of that node's jobs (:meth:`window`)."""

    @abc.abstractmethod
    def extend_lease(self, job: Job, lease_s: float) -> bool:
        """The heartbeat: extend the lease; False means the claim was lost (stop; delete any shard)."""

    @abc.abstractmethod
    def publish(self, job: Job, nbytes: int, checksum: str, commit=None) -> bool:
        """claimed -> written, only if this attempt still holds the claim. ``commit()`` (e.g. the
        shard's rename into place) runs inside the transaction, after the ownership check; if it
        raises, nothing changes. False (and commit not called) when the claim was lost."""

    @abc.abstractmethod
    def give_back(self, job: Job, reason: str = "given back") -> bool:
        """claimed -> pending, not counted as an error (signal, shutdown, disk full)."""

    @abc.abstractmethod
    def fail(self, job: Job, error: str, max_attempts: int) -> str | None:
        """Record an error: back to pending, or ``failed`` once errors reach max_attempts;
        returns the new state (None if the claim was lost)."""

    @abc.abstractmethod
    def retry_failed(self) -> int:
        """failed -> pending with the error count reset."""

    # ------------------------------------------------------------------ train side
    @abc.abstractmethod
    def take(self, trainer: str, rank: int, n: int, node: str | None = None) -> list[Job]:
        """Admit up to n written, untaken shards, oldest first, marking them taken by (trainer, rank);
        with ``node``, only shards that node wrote (a node-local store)."""

    @abc.abstractmethod
    def retake(self, trainer: str, rank: int, job_ids: Iterable[int]) -> list[Job]:
        """Mark these jobs taken by (trainer, rank) again (a checkpoint's buffer, on resume): only
        those written and untaken, or taken by this (trainer, rank) already, never one that another
        rank took meanwhile; returns those, in the given order."""

    @abc.abstractmethod
    def consume(self, job_ids: Iterable[int], step: int, rank_of: dict[int, int] | None = None) -> None:
        """Optimizer step ``step`` completed using these shards: written -> consumed, all or nothing.
        ``rank_of`` (job id -> the rank that trained it) is recorded. ManifestError, naming the jobs
        and their states, and nothing changes, if a job is listed twice, is not ``written``, or is
        taken by another rank than ``rank_of`` names (a job taken by no one is accepted)."""

    @abc.abstractmethod
    def release(self, job_ids: Iterable[int], keep: bool = False) -> None:
        """A durable checkpoint covers these consumed jobs: -> released (shard deleted) or kept."""

    @abc.abstractmethod
    def requeue(self, job_id: int, reason: str) -> bool:
        """A shard failed verification: written/consumed -> pending for re-extraction."""

    @abc.abstractmethod
    def requeue_absent_nodes(self, nodes: list[str]) -> tuple[int, int]:
        """Node-local stores (:mod:`.layout`), at a trainer's start: written jobs held by a node not in
        ``nodes`` (its shards are on a disk no rank of this trainer reads: a lost node) go back to
        pending, and consumed ones (a checkpoint covers them) are marked released, their files left
        to that node's cleanup should it return; one transaction. Returns (requeued, released)."""

    @abc.abstractmethod
    def resume_trainer(self, covered: dict[int, int]) -> list[int]:
        """Reconcile with a checkpoint (``covered``: job id -> the step that consumed it), in one
        transaction; returns the covered jobs now consumed (to delete or keep, then release)."""

    # ------------------------------------------------------------------ processes
    @abc.abstractmethod
    def register(
        self,
        role: str,
        *,
        group_id: str | None = None,
        rank: int | None = None,
        info: dict | None = None,
        exclusive: bool = False,
    ) -> str:
        """Record this process; with ``exclusive``, refuse (TrainerBusyError) if a live process of
        ``role`` from another group holds the manifest. Returns the registration id."""

    @abc.abstractmethod
    def unregister(self, proc_id: str) -> None: ...

    @abc.abstractmethod
    def check_fence(self) -> None:
        """ManifestError if this handle's exclusive (trainer) registration was replaced by another
        trainer's (it lapsed); a no-op for a handle that holds none. Run it before an irreversible
        act outside the manifest (writing a checkpoint, deleting shards)."""

    @abc.abstractmethod
    def live_procs(self, role: str | None = None) -> list[Proc]: ...

    @abc.abstractmethod
    def report(self, role: str, figures: dict, final: bool = False) -> None:
        """Publish this process's busy and idle figures (:mod:`.balance`) with its registration of
        ``role``, as its ``info["balance"]`` (a no-op without one); with ``final`` also as the event
        ``balance:<role>``, which outlives the registration."""

    def unregister_me(self, role: str) -> None:
        """Drop this process's registrations of ``role``."""
        from dflash_staged.procs import my_identity

        host, pid, _ = my_identity()
        for p in self.live_procs(role):
            if (p.host, p.pid) == (host, pid):
                self.unregister(p.id)

    @abc.abstractmethod
    def ever_registered(self, role: str) -> bool:
        """Whether a process of ``role`` ever started on this manifest."""

    @abc.abstractmethod
    def log_event(self, kind: str, detail: str = "", job: int | None = None) -> None: ...


__all__ = ["Manifest", "STATES"]
