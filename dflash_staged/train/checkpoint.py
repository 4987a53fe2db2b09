"""Trainer checkpoints: the resume point and the proof of what was trained.

Format, version :data:`FORMAT_VERSION` (one directory per checkpoint; no pickle anywhere)::

    RUN_DIR/checkpoints/step_{step:08d}/
        config.json               the drafter in the reference DFlash format (servable as is:
        model.safetensors         weights in the dtype config.json declares), see model.weights
        trainer/trainer_state.safetensors
                                  "master.<param>"            fp32 master weights
                                  "opt.<param>.exp_avg", "opt.<param>.exp_avg_sq"   AdamW moments
        trainer_state.json        {"format_version": 2,
                                   "step": optimizer steps completed,
                                   "total_steps": the lr/noise schedule's length,
                                   "opt_steps": AdamW's step count,
                                   "consumed": {step: [[job id, rank, real tokens, bucket,
                                                        mean sequence length, token digest], ...]}
                                               for every step (train.ledger.Consumed; the digest,
                                               absent before it existed, is of the ids trained),
                                   "buffer": [[job ids admitted, in draw order], one list per rank],
                                   "generators": [{"draw": b64, "anchor": b64}, one per rank]
                                                 (torch.Generator states: buffer draws, anchors),
                                   "world": trainer ranks, "mode": "live" | "replay",
                                   "replay_pos": jobs of the replay sequence admitted (replay),
                                   "manifest_id", "config" (resolved snapshot), "drafter_config",
                                   "chat": the manifest's chat rendering record (template text and
                                           kwargs; dflash eval renders prompts with it),
                                   "time": unix seconds}

The trainer's tensors live in the ``trainer/`` subfolder because the serving engines load every
``*.safetensors`` file at the top of the directory they are given (vLLM refuses ``master.*`` as keys no
module has): the checkpoint directory itself is what a user serves. Version 1 (before 2026-12) kept
``trainer_state.safetensors`` beside ``model.safetensors``; such checkpoints still resume and warm-start
(:func:`trainer_tensors_file`).

In memory the format is one :class:`TrainerState`. Each stateful component of the trainer gives
and restores its own part of it (:class:`Stateful`: ``state_dict`` / ``load_state_dict``), so
adding a component is registering it in one place (``Trainer.states``); a component marked
``per_rank`` gives one value per rank, stored as a list over ranks under each of its keys.

A checkpoint is written with :func:`dflash_staged.fsutil.atomic_dir` (temporary sibling, every file
fsynced, renamed into place, parent fsynced): a directory named ``step_X`` is always complete. Only the newest
checkpoint is a resume point; the last ``keep`` are kept. The trainer deletes (or keeps) a
shard only after a checkpoint covering the step that consumed it is durable, so falling back
to an older checkpoint could re-train or lose data: if the newest checkpoint cannot be read,
resuming fails loudly instead.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_dir, dir_bytes
from dflash_staged.train.ledger import Consumed

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: trainer_state.safetensors at the top of the directory
TRAINER_TENSORS = "trainer/trainer_state.safetensors"
LEGACY_TRAINER_TENSORS = "trainer_state.safetensors"


def trainer_tensors_file(ckpt_dir: Path) -> Path:
    """The trainer-state tensors of checkpoint ``ckpt_dir``: ``trainer/`` (version 2), else the top of the
    directory (version 1)."""
    new = Path(ckpt_dir) / TRAINER_TENSORS
    return new if new.exists() else Path(ckpt_dir) / LEGACY_TRAINER_TENSORS


_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(DflashError):
    """A checkpoint cannot be read or does not fit this run."""


class CheckpointDiskFullError(DflashError):
    """No space left on the disk of the run directory while a checkpoint was written: nothing of it is
    left, the older checkpoints and the manifest are intact, and a rerun resumes from the newest."""


class Stateful(Protocol):
    """A trainer component that gives and restores its own part of a checkpoint.

    ``state_dict()`` returns the keys it owns: tensors go to ``trainer_state.safetensors``, every
    other value (JSON-able) to ``trainer_state.json``; no two components may own the same key.
    ``load_state_dict(state)`` reads them back from a :class:`TrainerState` (or, for a component
    whose class sets ``per_rank = True``, from its rank's view of it)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class TrainerState(Mapping):
    """One checkpoint's trainer state: the JSON values and the tensors, read as one mapping."""

    values: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None  # where it was read from (for messages)

    def __getitem__(self, key: str) -> Any:
        return self.values[key] if key in self.values else self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter([*self.values, *self.tensors])

    def __len__(self) -> int:
        return len(self.values) + len(self.tensors)

    def for_rank(self, rank: int) -> Mapping[str, Any]:
        """What a ``per_rank`` component of ``rank`` reads: each value is its rank's element."""
        return _RankView(self, rank)

    def consumed(self) -> dict[int, list[Consumed]]:
        """step -> the jobs it trained on (the ledger's record)."""
        return {int(s): [Consumed(*c) for c in v] for s, v in self.values.get("consumed", {}).items()}

    def consumed_jobs(self) -> dict[int, int]:
        """job id -> the step that consumed it."""
        return {c.job: step for step, items in self.consumed().items() for c in items}

    @classmethod
    def collect(cls, states: dict[str, Stateful], gather: Callable[[Any], list]) -> TrainerState:
        """Every component's part (collective: ``gather`` collects a per-rank value from every rank)."""
        values: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        owner: dict[str, str] = {}
        for name, comp in states.items():
            part = comp.state_dict()
            if getattr(comp, "per_rank", False):
                bad = [k for k, v in part.items() if torch.is_tensor(v)]
                if bad:
                    raise ValueError(
                        f"trainer component {name!r} is per rank: its part must be JSON values, "
                        f"not the tensor {bad[0]!r}"
                    )
                ranks = gather(part)  # this component's part of every rank
                part = {k: [r[k] for r in ranks] for k in part}
            for k, v in part.items():
                if k in owner or k == "format_version":
                    raise ValueError(
                        f"trainer components {owner.get(k, 'checkpoint')!r} and {name!r} "
                        f"both write the checkpoint key {k!r}"
                    )
                owner[k] = name
                (tensors if torch.is_tensor(v) else values)[k] = v
        return cls(values, tensors)

    @property
    def ranks(self) -> int:
        """How many ranks wrote it (each ``per_rank`` value is a list of that length)."""
        return int(self.values.get("world", 1))

    def restore(self, states: dict[str, Stateful], rank: int) -> None:
        """Give every component its part back, in registration order. A rank the checkpoint has no part
        for (a run resumed on more ranks) keeps its ``per_rank`` components as built: an empty buffer,
        generators seeded from the run's seed and the rank."""
        for comp in states.values():
            if not getattr(comp, "per_rank", False):
                comp.load_state_dict(self)
            elif rank < self.ranks:
                comp.load_state_dict(self.for_rank(rank))


class _RankView(Mapping):
    def __init__(self, state: TrainerState, rank: int):
        self.state, self.rank = state, rank

    def __getitem__(self, key: str) -> Any:
        return self.state.values[key][self.rank]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state.values)

    def __len__(self) -> int:
        return len(self.state.values)


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


def resolve_checkpoint(path: str | Path, flag: str) -> Path:
    """A drafter checkpoint directory (config.json + model.safetensors), or a run directory's newest."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise DflashError(
            f"{flag} {path}: neither a drafter checkpoint (config.json + model.safetensors) "
            "nor a run directory with checkpoints/step_*; give one of those"
        )
    return latest


def cleanup_tmp(run_dir: Path) -> None:
    """Remove checkpoints a killed trainer left half-written."""
    d = checkpoints_dir(run_dir)
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".step_") and ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(
    run_dir: Path, step: int, *, write_drafter: Callable[[Path], None], state: TrainerState, keep: int
) -> Path:
    """Write checkpoint ``step`` atomically. ``write_drafter(dir)`` writes config.json + model.safetensors.
    A full disk is a :class:`CheckpointDiskFullError` naming the bytes needed, with nothing left behind."""
    drafter_bytes = None
    try:
        with atomic_dir(checkpoints_dir(run_dir) / f"step_{step:08d}", replace=True) as tmp:
            write_drafter(tmp)
            drafter_bytes = dir_bytes(tmp)
            (tmp / TRAINER_TENSORS).parent.mkdir()
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in state.tensors.items()},
                str(tmp / TRAINER_TENSORS),
            )
            values = {**state.values, "format_version": FORMAT_VERSION}
            (tmp / "trainer_state.json").write_text(json.dumps(values, sort_keys=True))
    except Exception as e:
        if not _disk_full(e):
            raise
        raise _full_error(run_dir, step, state.tensors, drafter_bytes) from None
    for _, p in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return checkpoints_dir(run_dir) / f"step_{step:08d}"


def _disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, as an OSError or as safetensors' writer reports it ("... (os error 28)")."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, OSError):
        return e.errno in codes
    return any(f"(os error {c})" in str(e) or os.strerror(c) in str(e) for c in codes)


def _full_error(
    run_dir: Path, step: int, tensors: dict[str, torch.Tensor], drafter_bytes: int | None
) -> CheckpointDiskFullError:
    """The one-line error: bytes one checkpoint takes (the newest one's size; else the tensors being
    written plus the drafter weights, about a third of them when not written yet)."""
    d = checkpoints_dir(run_dir)
    older = list_checkpoints(run_dir)
    state = sum(t.numel() * t.element_size() for t in tensors.values())
    drafter = state // 3 if drafter_bytes is None else drafter_bytes
    need = dir_bytes(older[-1][1]) if older else state + drafter
    free = shutil.disk_usage(d if d.is_dir() else run_dir).free
    return CheckpointDiskFullError(
        f"no space left on the disk of checkpoint directory {d} while writing checkpoint step_{step:08d} "
        f"({need} bytes needed, {free} free); nothing of it was left, the older checkpoints and the manifest "
        "are intact. Free space (the disk must hold train.keep_checkpoints + 1 checkpoints while one is "
        "written) and rerun the same command: it resumes from the newest checkpoint"
    )


def load_checkpoint(path: Path) -> TrainerState:
    """The trainer state of a checkpoint directory; CheckpointError if it cannot be read."""
    try:
        tensors = load_file(str(trainer_tensors_file(path)))
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"the newest checkpoint {path} cannot be read ({type(e).__name__}: {e}). Shards it covered may "
            "already be deleted, so resuming from an older one could lose or repeat data: restore this "
            "directory, or start a new --out run"
        ) from None
    version = state.get("format_version", 1)  # the first format had no version key
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path} has trainer-state format_version {version}; this dflash-staged "
            f"reads {', '.join(map(str, READABLE_VERSIONS))}: resume it with the version that wrote it, "
            "or start a new --out"
        )
    return TrainerState(state, tensors, Path(path))
