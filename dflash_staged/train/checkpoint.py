"""Trainer checkpoints: the resume point and the proof of what was trained.

Format (one directory per checkpoint; no pickle anywhere)::

    RUN_DIR/checkpoints/step_{step:08d}/
        config.json               the drafter in the reference DFlash format
        model.safetensors         (servable as is; weights in the dtype config.json declares)
        trainer_state.safetensors fp32 master weights   "master.<param name>"
                                  AdamW moments         "opt.<param name>.exp_avg" / ".exp_avg_sq"
                                  RNG states (uint8)    "rng.<name>"
        trainer_state.json        step, optimizer step count, lr schedule, buffer job ids (draw
                                  order), the jobs each step consumed {step: [[job, rank, tokens], ...]},
                                  epoch position, manifest id, config snapshot, drafter config

A checkpoint is written under ``.step_X.tmp-<pid>``, every file fsynced, then
renamed into place and the parent fsynced: a directory named ``step_X`` is
always complete. Only the newest checkpoint is a resume point; the last
``keep`` are kept. The trainer deletes (or keeps) a shard only after a
checkpoint covering the step that consumed it is durable, so falling back to
an older checkpoint could re-train or lose data: if the newest checkpoint
cannot be read, resuming fails loudly instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import fsync_path

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(DflashError):
    """A checkpoint cannot be read or does not fit this run."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    d = checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> Path | None:
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def cleanup_tmp(run_dir: Path) -> None:
    d = checkpoints_dir(run_dir)
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".step_") and ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str]) -> tuple[dict, int]:
    """AdamW state as flat named tensors, and its step count."""
    out, steps = {}, 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            n = names[p]
            out[f"opt.{n}.exp_avg"] = st["exp_avg"]
            out[f"opt.{n}.exp_avg_sq"] = st["exp_avg_sq"]
            steps = int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
    return out, steps


def restore_optimizer(opt: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], tensors: dict,
                      steps: int) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            n = names[p]
            if f"opt.{n}.exp_avg" not in tensors:
                continue
            opt.state[p] = {"step": torch.tensor(float(steps)),
                            "exp_avg": tensors[f"opt.{n}.exp_avg"].to(p.device, p.dtype),
                            "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"].to(p.device, p.dtype)}


def save_checkpoint(run_dir: Path, step: int, *, write_drafter, tensors: dict[str, torch.Tensor],
                    state: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically. `write_drafter(dir)` writes config.json + model.safetensors."""
    d = checkpoints_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step_{step:08d}"
    tmp = d / f".step_{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_drafter(tmp)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "trainer_state.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps(state, sort_keys=True))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if final.exists():  # a stale copy of the same step from a run that died before its metrics landed
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for s, p in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, state) of a checkpoint directory; CheckpointError if it cannot be read."""
    try:
        tensors = load_file(str(path / "trainer_state.safetensors"))
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"the newest checkpoint {path} cannot be read ({type(e).__name__}: {e}). Shards it covered may "
            "already be deleted, so resuming from an older one could lose or repeat data: restore this "
            "directory, or start a new --out run") from None
    return tensors, state


def consumed_jobs(state: dict[str, Any]) -> dict[int, int]:
    """job id -> step, from a checkpoint's per-step consumption record."""
    return {int(j[0]): int(step) for step, items in state.get("consumed", {}).items() for j in items}
