"""What one ``dflash extract`` run is asked to do: manifest, store, devices (and their tensor-parallel
groups), window, lease, the groups' collective timeout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_staged.config import ExtractConfig
from dflash_staged.errors import DflashError
from dflash_staged.extract.group import split_groups

EXIT_DISK_FULL = 3
EXIT_ERROR = 2
EXIT_RESTART = 4  # a forward raised on a rank of a tensor-parallel group: restart the group (extract.forward)


@dataclass
class ExtractOptions:
    manifest: str | Path  # a manifest address (see dflash_staged.manifest)
    store: Path
    devices: list[str]
    window: int
    window_bytes: int
    lease_s: float  # a claim's lease (extract.lease_s)
    max_attempts: int  # failures before a job is marked failed (extract.max_attempts)
    allow_slow_kernels: bool = False
    dtype: str | None = None  # override target.dtype for the shards' source model
    train_ranks: int = 1
    collective_timeout_s: float = 0.0  # a tensor-parallel group's (extract.collective_timeout_s); 0 = lease_s
    tp: int = 1  # devices per worker: a tensor-parallel group (dflash_staged.extract.group)
    trainer_coming: bool = False  # a launcher starts a trainer beside it (--trainer-coming)
    trainer_deadline: float = 0.0  # until then, wait for a trainer to register (extract.worker.should_stay)
    trainer_seen: bool = False  # this process saw a live trainer (extract.worker.should_stay)
    node_local: bool = False  # a store per node (dflash_staged.manifest.layout): windows per node
    node: str | None = None  # with node_local, this node's name (set by run_extract)
    engine: str = "transformers"  # target.engine (set by run_extract): "vllm" = one process per worker

    def __post_init__(self) -> None:
        self.collective_timeout_s = self.collective_timeout_s or self.lease_s

    @property
    def groups(self) -> list[list[str]]:
        """The devices of each worker: one each, or consecutive groups of ``tp``."""
        return split_groups(self.devices, self.tp)


def parse_devices(devices: str) -> list[str]:
    """``cpu,cpu`` or ``cuda:0,cuda:1`` -> the list; clear errors for unknown or absent devices."""
    devs = [d.strip() for d in devices.split(",") if d.strip()]
    if not devs:
        raise DflashError("--devices is empty: give e.g. 'cpu', 'cpu,cpu' or 'cuda:0,cuda:1'")
    for d in devs:
        if not (d == "cpu" or d.startswith("cuda")):
            raise DflashError(f"--devices: unknown device {d!r}; use cpu or cuda:N")
        if d.startswith("cuda") and not torch.cuda.is_available():
            raise DflashError(f"--devices {d}: CUDA is not available on this machine; use --devices cpu")
        if d.startswith("cuda"):
            try:
                index = torch.device(d).index
            except RuntimeError:
                raise DflashError(f"--devices: cannot read device {d!r}; use cuda:N") from None
            n = torch.cuda.device_count()
            if index is not None and index >= n:
                raise DflashError(
                    f"--devices {d}: this machine shows {n} GPU(s) (cuda:0..cuda:{n - 1}, after "
                    "CUDA_VISIBLE_DEVICES); pick devices that exist"
                )
    return devs


def options_from(
    manifest: str | Path,
    store: Path,
    devices: str,
    cfg: ExtractConfig,
    *,
    window=None,
    window_bytes=None,
    allow_slow_kernels=False,
    dtype=None,
    train_ranks=1,
    tp=1,
    trainer_coming=False,
    node_local=False,
) -> ExtractOptions:
    """Command-line values over the manifest's ``[extract]`` snapshot."""
    opts = ExtractOptions(
        manifest=manifest,
        store=store,
        devices=parse_devices(devices),
        window=window if window is not None else cfg.window,
        window_bytes=window_bytes if window_bytes is not None else cfg.window_bytes,
        lease_s=cfg.lease_s,
        max_attempts=cfg.max_attempts,
        allow_slow_kernels=allow_slow_kernels,
        dtype=dtype,
        train_ranks=train_ranks,
        collective_timeout_s=cfg.collective_timeout,
        tp=tp,
        trainer_coming=trainer_coming,
        node_local=node_local,
    )
    split_groups(opts.devices, tp)  # refuse a device count --tp does not divide, before anything starts
    return opts
