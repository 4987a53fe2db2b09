"""Tensor-parallel extract workers: N processes, one target split over N devices, one worker.

``dflash extract --tp N --devices D1,...,Dk`` makes k/N groups of N consecutive devices
(:func:`split_groups`; ``--tp 4 --devices cuda:0,...,cuda:7`` is two groups of four GPUs,
``--tp 2 --devices cpu,cpu`` one group of two CPU processes). In the manifest's eyes a group is one
worker: one claim at a time, one shard per job, one lease. Each group is a ``torch.distributed``
world of its own (gloo on CPU, NCCL on CUDA) that meets through a fresh file named by the
supervisor (``init_method=file://``: no ports to pick), with a process-group timeout of
``extract.collective_timeout_s`` (by default ``extract.lease_s``, so no rank waits in a collective
longer than a claim lives).

Roles: rank 0, the **leader**, runs the worker loop of :mod:`~dflash_staged.extract.worker`: it
alone claims, keeps the lease, writes and publishes (the full, unsharded tapped states: every
rank's layer outputs are whole, see :mod:`dflash_staged.model.target.parallel`), and the claim carries
its pid. The **followers** (ranks 1..N-1) hold their slice of the target and run :func:`follow`
on what the leader broadcasts (:meth:`Group.send`):

* ``("job", input_ids, attention_mask)``: the same early-stopped forward, keeping nothing;
* ``("idle",)``: nothing to compute; sent every :data:`IDLE_EVERY_S` while the leader waits, so a
  follower's wait for the next message stays far below the timeout;
* ``("stop",)``: exit 0 (the leader is done, or was asked to stop).

After loading all ranks agree whether they succeeded (:meth:`Group.all_ok`): a load that failed
anywhere stops the whole group before anything is claimed. After every forward the ranks meet in
:meth:`Group.all_ok` again, as a barrier: only a rank whose forward returned calls it. A forward
that raises on a rank (out of memory, most likely on the leader, which alone holds the full tap
buffer) ends that process at once, with no further collective, and the supervisor restarts the
group (:mod:`~dflash_staged.extract.forward`: the other ranks may still be inside one of the
model's collectives, which no later call of another collective may be paired with); the leader
first sends the job back to pending (whether that counts an attempt: ``counts_attempt`` there). A
broken group (a rank gone, a collective timed out) raises on the survivors, which exit; the
supervisor then stops every process of the group, the job goes back to pending (the leader gave
it back, or it is reclaimed from the dead leader's pid) and the group is restarted or reported
(:mod:`~dflash_staged.extract.supervisor`). A group of one
(``--tp 1``) is :class:`Group` with ``size=1``: every method is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch

from dflash_staged.errors import DflashError
from dflash_staged.extract.forward import RankFailed

IDLE_EVERY_S = 1.0


def split_groups(devices: list[str], tp: int) -> list[list[str]]:
    """``devices`` cut into consecutive groups of ``tp``; errors name the flag and the fix."""
    if tp < 1:
        raise DflashError(f"--tp {tp}: the tensor-parallel size must be >= 1")
    if len(devices) % tp:
        raise DflashError(
            f"--tp {tp} does not divide the {len(devices)} device(s) of --devices "
            f"{','.join(devices)}: give a multiple of {tp} devices (each worker gets {tp})"
        )
    groups = [devices[i : i + tp] for i in range(0, len(devices), tp)]
    for g in groups if tp > 1 else []:
        kinds = {torch.device(d).type for d in g}
        if len(kinds) > 1:
            raise DflashError(
                f"--tp {tp}: the group {','.join(g)} mixes CPU and CUDA devices; a tensor-parallel "
                "group needs devices of one kind"
            )
        if kinds == {"cuda"}:
            idx = [torch.device(d).index for d in g]
            if None in idx or len(set(idx)) != len(idx):
                raise DflashError(
                    f"--tp {tp}: the group {','.join(g)} needs {tp} distinct GPUs named with their "
                    "index, e.g. cuda:0,cuda:1"
                )
    return groups


class GroupBroken(DflashError):
    """A collective of the group failed: a rank is gone, or did not answer within the timeout."""


@contextlib.contextmanager
def _collective(group: Group, what: str):
    try:
        yield
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses with multi-line texts
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GroupBroken(
            f"rank {group.rank} of a tensor-parallel group of {group.size}: {what} failed "
            f"({type(e).__name__}: {first[:300]}); another rank of the group died or hung, so "
            "this one stops too"
        ) from None


class Group:
    """This process's place in its worker group (see the module docstring)."""

    def __init__(self, rank: int = 0, size: int = 1, comm_device: torch.device | None = None):
        self.rank, self.size = rank, size
        self._comm = comm_device or torch.device("cpu")
        self._last_send = time.monotonic()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, devices: list[str], rank: int, init_file: str, timeout_s: float) -> Group:
        """Become rank ``rank`` of the group on ``devices``; call before anything touches CUDA."""
        import torch.distributed as td

        device = torch.device(devices[rank])
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(len(devices)),
            LOCAL_WORLD_SIZE=str(len(devices)),
            LOCAL_RANK=str(device.index if device.type == "cuda" else rank),
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # a CPU group on a GPU machine must not let transformers pick the GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        td.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=len(devices),
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        return cls(rank, len(devices), device)

    def send(self, msg: tuple) -> None:
        """Leader: broadcast one message to the followers."""
        if self.size > 1:
            import torch.distributed as td

            with _collective(self, f"sending {msg[0]!r}"):
                td.broadcast_object_list([msg], src=0, device=self._comm)
            self._last_send = time.monotonic()

    def recv(self) -> tuple:
        """Follower: the leader's next message."""
        import torch.distributed as td

        box = [None]
        with _collective(self, "waiting for the leader"):
            td.broadcast_object_list(box, src=0, device=self._comm)
        return box[0]

    def idle(self) -> None:
        """Leader, while it waits: tell the followers it is alive, at most every IDLE_EVERY_S."""
        if self.size > 1 and time.monotonic() - self._last_send >= IDLE_EVERY_S:
            self.send(("idle",))

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a collective: every rank must call it)."""
        if self.size == 1:
            return ok
        import torch.distributed as td

        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self._comm)
        with _collective(self, "agreeing on the result"):
            td.all_reduce(flag, op=td.ReduceOp.MIN)
        return bool(flag.item())

    def stop(self) -> None:
        """Leader: tell the followers to exit (best effort: the group may already be broken)."""
        try:
            self.send(("stop",))
        except Exception:  # noqa: BLE001 - a dead follower cannot be told anything
            pass

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as td

            try:
                td.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def follow(target, group: Group) -> None:
    """Follower loop: run the leader's forwards until it says stop. A broken group raises
    :class:`GroupBroken`; a forward that raises, :class:`~dflash_staged.extract.forward.RankFailed`
    (the process must then exit without another collective)."""
    while True:
        msg = group.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "job":
            try:
                out = target.capture(msg[1], msg[2], keep=bool(target.topk))
                if target.topk:  # the leader's head runs on the packed tokens: the same collectives here
                    from dflash_staged.model.target import pack_unpadded

                    target.topk_of(pack_unpadded(out, msg[2].sum(1).tolist())[:, -1])
            except Exception as e:  # noqa: BLE001 - no all_ok: the others may be in a model collective
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise RankFailed(
                    f"rank {group.rank} of a tensor-parallel group of {group.size}: the forward failed "
                    f"({type(e).__name__}: {first[:300]}); this process exits and the group is restarted"
                ) from None
            group.all_ok(True)
