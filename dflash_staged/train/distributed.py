"""Data-parallel training ranks: torch.distributed when launched by torchrun, else one no-op rank.

Gradients are summed with one flat all-reduce after the microbatches of a step; every rank takes
part in every collective (a rank with no data contributes zeros), so the final drain never hangs.

**Collective timeout.** The group is created with a timeout of ``DFLASH_TRAIN_COLLECTIVE_TIMEOUT_S``
seconds (default :data:`COLLECTIVE_TIMEOUT_S`, 2 hours) instead of torch's 10 minutes, and on CUDA
with ``device_id`` (NCCL binds the group to this rank's GPU at once, and barriers never guess the
device). Waiting for shards never sits in a collective: ranks poll together every fraction of a
second (:mod:`dflash_staged.train.draw`). The timeout is for the long one-rank stretches between
two collectives: rank 0 writing a checkpoint while the others wait in the barrier, a first step's
compiles, a slow manifest. A rank that dies seldom holds the others that long (torchrun ends
the ranks of its node, and NCCL reports a lost peer as an error); one that hangs does.

**A lost peer** (its rank or its whole node died) fails this rank's next collective: that is reported in
one line (:class:`PeerLostError`), not a backend traceback. Under an elastic agent
(:mod:`dflash_staged.launch.elastic`) the job then re-forms by itself; otherwise the recovery is
rerunning the trainer on the nodes that remain (``docs/multinode.md``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import uuid
from typing import Any

import torch

from dflash_staged.errors import DflashError

COLLECTIVE_TIMEOUT_S = 2 * 3600.0
TIMEOUT_ENV = "DFLASH_TRAIN_COLLECTIVE_TIMEOUT_S"


class PeerLostError(DflashError):
    """A collective failed: another rank is gone."""


@contextlib.contextmanager
def collective(what: str, rank: int):
    """Run one collective; a backend error (a peer died, its connection closed) as :class:`PeerLostError`."""
    try:
        yield
    except DflashError:
        raise
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...)
        detail = " ".join(str(e).split())[:300]
        raise PeerLostError(
            f"train rank {rank}: the collective {what} failed ({detail}): another trainer rank is gone (its "
            "process or its node died). An elastic job (--nnodes MIN:MAX) re-forms by itself; otherwise "
            "rerun the trainer command (with --node-local stores, on the nodes that remain: the lost node's "
            "shards go back to extract; docs/multinode.md)"
        ) from None


def collective_timeout_s() -> float:
    """The process group's timeout in seconds (see the module docstring)."""
    raw = os.environ.get(TIMEOUT_ENV) or ""
    try:
        s = float(raw) if raw else COLLECTIVE_TIMEOUT_S
    except ValueError:
        s = -1.0
    if not 0 < s < 1e9:  # also refuses nan and inf
        raise DflashError(f"{TIMEOUT_ENV}={raw!r}: must be a number of seconds > 0")
    return s


def init_kwargs(device: torch.device) -> dict[str, Any]:
    """``torch.distributed.init_process_group``'s arguments for a trainer rank on ``device``."""
    kw: dict[str, Any] = {
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "timeout": datetime.timedelta(seconds=collective_timeout_s()),
    }
    if device.type == "cuda":
        kw["device_id"] = (
            device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        )
    return kw


class Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), else a no-op single rank."""

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.enabled = self.world > 1
        if self.enabled:
            import torch.distributed as td

            td.init_process_group(**init_kwargs(device))
            self.td = td
        self.device = device
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id in (
            None,
            "",
            "none",
        ):  # torchrun's static rendezvous (--master-addr, several nodes) names no run
            run_id = (
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}" if self.enabled else None
            )
        self.group_id = (
            run_id or uuid.uuid4().hex
        )  # the ranks of one job share it: one trainer for the manifest

    def any(self, flag: bool) -> bool:
        return self.sum_int(int(flag)) > 0

    def sum_int(self, n: int) -> int:
        if not self.enabled:
            return n
        t = torch.tensor([n], dtype=torch.long, device=self._comm_device())
        with collective("all_reduce", self.rank):
            self.td.all_reduce(t)
        return int(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        if not self.enabled or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).to(self._comm_device())
        with collective("all_reduce", self.rank):
            self.td.all_reduce(flat)
        off = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t).to(t.device, t.dtype))
            off += n

    def gather_jobs(self, items: list) -> list:
        if not self.enabled:
            return list(items)
        out: list[Any] = [None] * self.world
        with collective("all_gather", self.rank):
            self.td.all_gather_object(out, items)
        return [x for part in out for x in part]

    def gather_obj(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        with collective("all_gather", self.rank):
            self.td.all_gather_object(out, obj)
        return out

    def broadcast_obj(self, obj, src: int):
        """``obj`` of rank ``src`` on every rank (a picklable value)."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        with collective("broadcast", self.rank):
            self.td.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast_bytes(self, data: bytes | None, n: int, src: int) -> bytes:
        """``n`` bytes of rank ``src`` (``data`` there; ignored elsewhere) on every rank, as one uint8
        tensor on the collective's device."""
        if not self.enabled:
            return data or b""
        dev = self._comm_device()
        if self.rank == src:
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        else:
            t = torch.empty(n, dtype=torch.uint8, device=dev)
        with collective("broadcast", self.rank):
            self.td.broadcast(t, src=src)
        return t.cpu().numpy().tobytes()

    def barrier(self) -> None:
        if self.enabled:
            with collective("barrier", self.rank):
                self.td.barrier()

    def close(self) -> None:
        if self.enabled:
            self.td.destroy_process_group()
