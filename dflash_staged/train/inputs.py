"""What a training run starts from, for :func:`dflash_staged.train.trainer.build_trainer`: the
device, the config (with ``--set`` overrides), the window check against extract's settings, the
store (waited for while extract creates it), and a recorded step order to replay."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from dflash_staged.config import REPLAY_OVERRIDABLE, Config, apply_overrides
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.manifest.window import WindowSettings
from dflash_staged.preflight import device as preflight_device
from dflash_staged.store import ShardStore
from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.options import TrainOptions

STORE_WAIT_POLL_S = 0.5


ALLOC_CONF = "expandable_segments:True"


def pick_device(name: str | None) -> torch.device:
    """``--device``, else CUDA when available; under torchrun each rank takes its LOCAL_RANK GPU. On CUDA
    the caching allocator gets expandable segments (less fragmentation across microbatches of varied
    shapes) unless ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` is set: before the first
    allocation, which is when the allocator reads it."""
    preflight_device(name)  # one line for a device that is not one, or not here
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", device.index or 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def run_config(m: Manifest, opts: TrainOptions) -> Config:
    """The manifest's config snapshot with the allowed ``--set`` overrides applied."""
    cfg = m.config
    if opts.overrides:
        allowed = REPLAY_OVERRIDABLE if opts.replay else {"train": REPLAY_OVERRIDABLE["train"]}
        cfg = apply_overrides(cfg, opts.overrides, allowed, "train --replay" if opts.replay else "train")
    return cfg


def check_window(m: Manifest, cfg: Config, ranks: int) -> None:
    """The window rule (:mod:`dflash_staged.manifest.window`) against the settings extract published."""
    err, warn = WindowSettings.from_meta(m.meta.get(WindowSettings.KEY), cfg.extract.window).check(cfg, ranks)
    if err:
        raise DflashError(f"{m.address}: extract runs with {err}")
    if warn:
        print(f"train: warning: {warn}", file=sys.stderr, flush=True)


def check_replay(m: Manifest, opts: TrainOptions) -> None:
    """``--replay`` needs the store and shards the live run kept: refused at once otherwise."""
    if not ShardStore.exists(opts.store):
        raise DflashError(f"replay: no store at {opts.store}; give the store the live run kept (--store)")
    if not m.counts().get("kept"):
        raise DflashError(
            f"replay: {m.address} has no kept shards to replay; run the live trainer with --keep-shards first"
        )


def wait_for_store(opts: TrainOptions, m: Manifest) -> ShardStore:
    """The store, once extract has created it (a replay needs it at once)."""
    said = False
    while not ShardStore.exists(opts.store):  # (a replay's store was checked: check_replay)
        if m.extract_done() and not m.counts()["written"]:
            raise DflashError(
                f"no store at {opts.store} although {m.address} has nothing left to extract; "
                "check --store (it must be the path given to `dflash extract`)"
            )
        if not said:
            print(
                f"train: waiting for the store at {opts.store} (start `dflash extract --manifest {m.address} "
                f"--store {opts.store}`)",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(STORE_WAIT_POLL_S)
    return ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id})


def load_order(path: Path) -> dict[int, list[int]]:
    """``--order-from RUN``: the jobs each step of that run consumed, from its newest checkpoint."""
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise DflashError(f"--order-from {path}: no checkpoint there to read the draw order from")
    return {step: [c.job for c in items] for step, items in ckpt.load_checkpoint(latest).consumed().items()}


SHARED_ENV = "DFLASH_TRAIN_SHARES_GPU_WITH_EXTRACT"  # set by `dflash pipeline` when one GPU runs both


def train_device_bytes(cfg: Config, device: torch.device) -> int | None:
    """The device memory the trainer's estimate may plan with: None (the whole device) unless the
    launcher says an extract worker shares this GPU (:data:`SHARED_ENV`); then the device's memory
    less what that worker holds (:func:`dflash_staged.model.target.dims.extract_footprint`)."""
    if device.type != "cuda" or os.environ.get(SHARED_ENV) != "1":
        return None
    from dflash_staged.model.target.dims import extract_footprint

    total = torch.cuda.get_device_properties(device).total_memory
    stored = len(cfg.target.target_layer_ids or [0] * cfg.drafter.num_hidden_layers)
    stored += 1 if cfg.target.store_last_layer else 0
    itemsize = 4 if cfg.target.dtype == "float32" else 2
    taken = extract_footprint(cfg.target, cfg.data.token_budget, stored, itemsize)
    print(
        f"train: sharing {device} with an extract worker: planning with {(total - taken) / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB (the target's weights and one job's prefill: {taken / 2**30:.1f} GiB)",
        file=sys.stderr,
        flush=True,
    )
    return max(0, total - taken)
