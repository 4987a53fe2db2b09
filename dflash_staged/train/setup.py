"""The pieces :func:`dflash_staged.train.trainer.build_trainer` assembles: the device, the config
(with ``--set`` overrides), the store (waited for while extract creates it), the drafter with
the target's frozen embedding and head, and a recorded step order to replay."""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

from dflash_staged.config import REPLAY_OVERRIDABLE, Config, apply_overrides
from dflash_staged.manifest.window import WindowSettings
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardStore
from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.options import TrainOptions

STORE_WAIT_POLL_S = 0.5


def pick_device(name: str | None) -> torch.device:
    """``--device``, else CUDA when available; under torchrun each rank takes its LOCAL_RANK GPU."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
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


def wait_for_store(opts: TrainOptions, m: Manifest) -> ShardStore:
    """The store, once extract has created it (a replay needs it at once)."""
    said = False
    while not ShardStore.exists(opts.store):
        if opts.replay:
            raise DflashError(f"replay: no store at {opts.store}; give the store the live run kept (--store)")
        if m.extract_done() and not m.counts()["written"]:
            raise DflashError(f"no store at {opts.store} although {m.address} has nothing left to extract; "
                              "check --store (it must be the path given to `dflash extract`)")
        if not said:
            print(f"train: waiting for the store at {opts.store} (start `dflash extract --manifest {m.address} "
                  f"--store {opts.store}`)", file=sys.stderr, flush=True)
            said = True
        time.sleep(STORE_WAIT_POLL_S)
    return ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id})


def build_drafter(cfg: Config, store: ShardStore, device: torch.device, init_from: Path | None = None):
    """A freshly initialised drafter for this target and store, with the frozen embedding and head;
    ``init_from`` (``--init-from``): start from another run's (or checkpoint's) weights instead."""
    from dflash_staged.model.dims import target_dims
    from dflash_staged.model.drafter import DFlashDrafter, DraftModelConfig
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.target_weights import load_embed_and_head
    from dflash_staged.model.weights import validate_mask_token
    dims = target_dims(cfg.target)
    if store.meta.hidden_size != dims.hidden_size:
        raise DflashError(f"store {store.root} holds hidden size {store.meta.hidden_size} but the target "
                          f"{cfg.target.model} has {dims.hidden_size}; use the store extracted from this target")
    embed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed, head = load_embed_and_head(cfg.target, dtype=embed_dtype, device=device)
    mask_id = validate_mask_token(cfg.drafter.mask_token_id, load_tokenizer(cfg.target), dims.vocab_size)
    from_target = cfg.drafter.init != "random"  # target_top, or auto
    if from_target and not cfg.drafter.intermediate_size:  # the target's MLP width, so it can be copied
        from dflash_staged.model.dims import target_text_config
        cfg = copy.deepcopy(cfg)
        cfg.drafter.intermediate_size = int(getattr(target_text_config(cfg.target), "intermediate_size", 0) or 0)
    dcfg = DraftModelConfig.from_config(cfg, dims.hidden_size, dims.vocab_size, dims.num_layers,
                                        list(store.meta.layer_ids), mask_id)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(dcfg, embed, head)
    if from_target and init_from is None:  # (a warm start replaces every weight anyway)
        drafter = init_from_target_layers(cfg, drafter, lambda: DFlashDrafter(dcfg, embed, head))
    if init_from is not None:
        src = warm_start(drafter, init_from)
        print(f"train: drafter initialised from {src}", file=sys.stderr, flush=True)
    return drafter.to(device)


def init_from_target_layers(cfg: Config, drafter, fresh):
    """``drafter.init``: target_top copies the target's top layers (or fails, naming the fix); auto
    does so where they fit and otherwise keeps random weights (``fresh()``, same seed), saying why."""
    from dflash_staged.model.init import init_from_target
    try:
        copied = init_from_target(drafter, cfg.target)
    except DflashError as e:
        if cfg.drafter.init == "target_top":
            raise
        torch.manual_seed(cfg.train.seed)
        print(f"train: drafter.init = 'auto': random weights, the target's layers do not fit ({e})",
              file=sys.stderr, flush=True)
        return fresh()
    print(f"train: drafter initialised from the target ({len(copied)} tensors; {copied[0]}, ...)",
          file=sys.stderr, flush=True)
    return drafter


def warm_start(drafter, path: Path) -> Path:
    """Copy a checkpoint's drafter weights (its fp32 masters when it has them) into ``drafter``."""
    from safetensors.torch import load_file
    ck = ckpt.resolve_checkpoint(path, "--init-from")
    masters = ck / "trainer_state.safetensors"
    if masters.is_file():
        state = {k[len("master."):]: v for k, v in load_file(str(masters)).items() if k.startswith("master.")}
    else:
        state = load_file(str(ck / "model.safetensors"))
    own = dict(drafter.named_parameters())
    bad = sorted(set(own) ^ set(state)) or [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise DflashError(f"--init-from {ck}: its drafter does not fit this one ({bad[0]} and {len(bad) - 1} more "
                          "differ); warm-start from a drafter of the same layers and sizes")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(state[k].to(p.dtype))
    return ck


def load_order(path: Path) -> dict[int, list[int]]:
    """``--order-from RUN``: the jobs each step of that run consumed, from its newest checkpoint."""
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise DflashError(f"--order-from {path}: no checkpoint there to read the draw order from")
    return {step: [c.job for c in items] for step, items in ckpt.load_checkpoint(latest).consumed().items()}
