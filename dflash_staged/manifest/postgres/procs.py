"""The PostgreSQL manifest's process registry: registrations, heartbeats, liveness, a trainer's fence.

A registration (table ``procs``) records role, host name, boot id, pid and start time, group and
rank. :class:`Registry` keeps this handle's registrations alive from a heartbeat thread on its own
connection, every lease / 4, where the lease is the plan's
:attr:`~dflash_staged.config.ExtractConfig.registration_liveness` (``extract.registration_liveness_s``,
by default ``extract.lease_s``; the manifest passes it in). A registration is alive when, on this
host, its process is (pid, start time, boot id: :func:`~dflash_staged.procs.pid_alive`), and, seen
from another host, while its heartbeat is younger than the lease. ``register`` takes an
advisory lock, drops dead registrations of its role, and with ``exclusive`` refuses a live one of
another group (one trainer, whose ranks share a group). An extractor's registration dropped while
its host was cut off is written again by its next heartbeat; an exclusive one is not: that trainer
was replaced, and :meth:`Registry.check_fence` (run in each of its transactions) stops it. That check
locks the registration row (``FOR KEY SHARE``) until its transaction ends, so a new trainer's
``register``, which deletes the lapsed registration, waits for any transaction the old trainer has
open, and then reconciles with everything it committed; a heartbeat (no key column changes) does
not wait. :func:`reclaim_dead_here` returns the claims of this host's dead processes to pending.
:meth:`Registry.report` keeps a process's busy and idle figures (:mod:`.balance`) in its row's ``info``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from dflash_staged.manifest.postgres.conn import PgAddress, Session
from dflash_staged.manifest.postgres.schema import FREE_CLAIM, LOCK_NS, NOW
from dflash_staged.manifest.states import ManifestError, Proc, TrainerBusyError
from dflash_staged.procs import BOOT_ID, my_identity, pid_alive

_INSERT = (
    f"INSERT INTO procs (id, role, host, boot_id, pid, pid_start, group_id, rank, info, started, heartbeat) "
    f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, {NOW}, {NOW})"
)


def alive(p: dict, now: float, lease: float) -> bool:
    """Whether registration row ``p`` is alive at server time ``now`` (see the module docstring)."""
    if p["host"] == my_identity()[0]:
        return pid_alive(p["host"], p["pid"], p["pid_start"], p["boot_id"])
    return p["heartbeat"] is not None and p["heartbeat"] >= now - lease


def reclaim_dead_here(cur) -> int:
    """Claims of this host's processes that are gone, back to pending (statements of their own)."""
    host = my_identity()[0]
    dead = [
        (r["id"], r["pid"])
        for r in cur.execute(
            "SELECT id, pid, pid_start, boot_id FROM jobs WHERE state = 'claimed' AND host = %s", (host,)
        ).fetchall()
        if not pid_alive(host, r["pid"], r["pid_start"], r["boot_id"])
    ]
    return sum(
        cur.execute(
            f"WITH gone AS (UPDATE jobs SET state = 'pending', {FREE_CLAIM}, "
            f"updated = {NOW} WHERE id = %s AND state = 'claimed' AND host = %s AND pid = %s "
            "RETURNING id) INSERT INTO events (t, job, kind, detail) "
            f"SELECT {NOW}, id, 'reclaim', %s FROM gone",
            (job_id, host, pid, f"worker pid {pid} is gone"),
        ).rowcount
        for job_id, pid in dead
    )


class Registry:
    """One manifest handle's registrations; see the module docstring."""

    def __init__(self, addr: PgAddress, session: Session, lease: Callable[[], float], event):
        self.addr, self._s, self._lease, self._event = addr, session, lease, event
        self._heart: _Heartbeat | None = None
        self.fence: str | None = None  # this handle's exclusive registration (a trainer's)

    def register(
        self, role: str, *, group_id: str | None, rank: int | None, info: dict | None, exclusive: bool
    ) -> str:
        host, pid, start = my_identity()
        pid_key, lease = f"{role}:{host}:{pid}:{start}", self._lease()
        row = (pid_key, role, host, BOOT_ID, pid, start, group_id, rank, json.dumps(info or {}))

        def body(cur, _):
            cur.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_NS, self.addr.name + ":procs")
            )
            for p in cur.execute(f"SELECT *, {NOW} AS now FROM procs WHERE role = %s", (role,)).fetchall():
                if not alive(p, p["now"], lease):
                    cur.execute("DELETE FROM procs WHERE id = %s", (p["id"],))
                elif exclusive and p["group_id"] != group_id and p["id"] != pid_key:
                    raise TrainerBusyError(
                        f"another {role} (host {p['host']}, pid {p['pid']}) already uses "
                        f"{self.addr.display}; stop it first, or run both as ranks of one DDP job "
                        "(torchrun); a process cut off from the server counts as alive until "
                        f"{lease:.0f} s (extract.registration_liveness_s, by default extract.lease_s) "
                        "after its last heartbeat"
                    )
            cur.execute(
                _INSERT + " ON CONFLICT (id) DO UPDATE SET heartbeat = EXCLUDED.heartbeat, "
                "group_id = EXCLUDED.group_id, rank = EXCLUDED.rank, info = EXCLUDED.info",
                row,
            )
            self._event(cur, None, f"start:{role}", json.dumps(info or {}))

        self._s.run(body)
        if exclusive:
            self.fence = pid_key
        if self._heart is None:
            self._heart = _Heartbeat(self.addr, max(0.25, lease / 4))
            self._heart.start()
        self._heart.hold(pid_key, row, exclusive)
        return pid_key

    def unregister(self, proc_id: str) -> None:
        if self._heart is not None:
            self._heart.drop(proc_id)
        if self.fence == proc_id:
            self.fence = None
        self._s.run(lambda cur, _: cur.execute("DELETE FROM procs WHERE id = %s", (proc_id,)))

    def report(self, role: str, figures: dict, final: bool) -> None:
        """This process's figures into its registration of ``role`` (see ``Manifest.report``)."""
        host, pid, start = my_identity()
        pid_key, info = f"{role}:{host}:{pid}:{start}", None

        def body(cur, _):  # a retry of a committed final report logs its event twice: readers keep the last
            nonlocal info
            if not final:  # figures, not state: no wait for the WAL flush (as heartbeats)
                cur.execute("SET LOCAL synchronous_commit TO off")
            row = cur.execute("SELECT info FROM procs WHERE id = %s", (pid_key,)).fetchone()
            if row is not None:
                info = json.dumps({**json.loads(row["info"] or "{}"), "balance": figures})
                cur.execute("UPDATE procs SET info = %s WHERE id = %s", (info, pid_key))
            if final:
                self._event(cur, None, f"balance:{role}", json.dumps(figures))

        self._s.run(body)
        if info is not None and self._heart is not None:
            self._heart.set_info(pid_key, info)

    def live(self, role: str | None) -> list[Proc]:
        lease = self._lease()
        q, args = (
            (f"SELECT *, {NOW} AS now FROM procs WHERE role = %s", (role,))
            if role
            else (f"SELECT *, {NOW} AS now FROM procs", ())
        )
        rows = self._s.run(lambda cur, _: cur.execute(q, args).fetchall())
        return [Proc.from_row(p, heartbeat=p["heartbeat"]) for p in rows if alive(p, p["now"], lease)]

    def check_fence(self, cur) -> None:
        """ManifestError unless this handle's exclusive registration is there; locks it (module docstring)."""
        row = cur.execute("SELECT 1 AS ok FROM procs WHERE id = %s FOR KEY SHARE", (self.fence,)).fetchone()
        if row is None:
            raise ManifestError(
                f"this trainer's registration on {self.addr.display} lapsed (no heartbeat for longer "
                "than the lease, e.g. cut off from the server) and another trainer replaced it: "
                "stopping without consuming more; rerun it to resume from its last checkpoint"
            )

    def close(self) -> None:
        if self._heart is not None:
            self._heart.stop.set()
            self._heart = None


class _Heartbeat(threading.Thread):
    """Keeps this process's registrations alive, on its own connection."""

    def __init__(self, addr: PgAddress, interval: float):
        super().__init__(daemon=True, name="manifest-heartbeat")
        self.addr, self.interval = addr, interval
        self.stop = threading.Event()
        self._regs: dict[str, tuple[tuple, bool]] = {}
        self._lock = threading.Lock()

    def hold(self, pid_key: str, row: tuple, exclusive: bool) -> None:
        with self._lock:
            self._regs[pid_key] = (row, exclusive)

    def drop(self, pid_key: str) -> None:
        with self._lock:
            self._regs.pop(pid_key, None)

    def set_info(self, pid_key: str, info: str) -> None:
        """The ``info`` a registration written again carries (its latest published figures)."""
        with self._lock:
            if pid_key in self._regs:
                row, exclusive = self._regs[pid_key]
                self._regs[pid_key] = ((*row[:8], info), exclusive)

    def _beat(self, cur, _) -> None:
        cur.execute("SET LOCAL synchronous_commit TO off")  # a heartbeat lost in a crash is only a late one
        for pid_key, (row, exclusive) in self._regs.items():
            if (
                cur.execute(f"UPDATE procs SET heartbeat = {NOW} WHERE id = %s", (pid_key,)).rowcount == 0
                and not exclusive
            ):  # dropped while this host was cut off: an extractor comes back
                cur.execute(_INSERT + " ON CONFLICT (id) DO NOTHING", row)

    def run(self) -> None:
        session = None
        while not self.stop.wait(self.interval):
            try:
                session = session or Session(self.addr)
                with self._lock:  # until committed: a registration dropped meanwhile is not written again
                    session.run(self._beat, retry=0)
            except ManifestError:
                pass  # unreachable now: try again at the next beat
        if session is not None:
            session.close()
