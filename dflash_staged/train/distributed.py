"""Data-parallel training ranks: torch.distributed when launched by torchrun, else one no-op rank.

Gradients are summed with one flat all-reduce after the microbatches of a step; every rank takes
part in every collective (a rank with no data contributes zeros), so the final drain never hangs.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch


class Dist:
    """torch.distributed when launched by torchrun (WORLD_SIZE > 1), else a no-op single rank."""

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.enabled = self.world > 1
        if self.enabled:
            import torch.distributed as td

            backend = "nccl" if device.type == "cuda" else "gloo"
            td.init_process_group(backend)
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
        self.td.all_reduce(t)
        return int(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        if not self.enabled or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).to(self._comm_device())
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
        self.td.all_gather_object(out, items)
        return [x for part in out for x in part]

    def gather_obj(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        self.td.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            self.td.barrier()

    def close(self) -> None:
        if self.enabled:
            self.td.destroy_process_group()
