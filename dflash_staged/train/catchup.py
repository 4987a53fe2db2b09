"""Catching up: every rank resumes from the newest checkpoint any rank holds.

With ``--out`` on each node's own disk (node-local stores), a node that was away for some checkpoints,
or a new node, holds an older one or none. At start the ranks compare their newest checkpoints
(collective); the lowest rank holding the newest sends it, file by file in chunks of
:data:`CHUNK` bytes, over the process group (no shared filesystem); every rank that writes its own
copy (``Trainer.ckpt_copy``) and lacks it receives it, checks every file's XXH3-64 digest against the
sender's, and writes it durably (:func:`dflash_staged.fsutil.atomic_dir`) before anyone resumes. The
newest is the one to resume: a checkpoint is written on every node before any shard it covers is
released, so an older one may be missing shards a resume would need.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import xxhash

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_dir
from dflash_staged.train import checkpoint as ckpt

CHUNK = 64 << 20


def _step(path: Path | None) -> int:
    return -1 if path is None else int(path.name.split("_")[1])


def _manifest_of(d: Path) -> list[tuple[str, int, str]]:
    """(relative path, size, xxh3-64) of every file of checkpoint directory ``d``."""
    out = []
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        h = xxhash.xxh3_64()
        with open(f, "rb") as fh:
            while block := fh.read(CHUNK):
                h.update(block)
        out.append((str(f.relative_to(d)), f.stat().st_size, h.hexdigest()))
    return out


def _send_or_receive(dist, src: int, receive: bool, here: Path | None, target: Path) -> None:
    """Rank ``src`` sends checkpoint ``here``; a rank with ``receive`` writes it to ``target``."""
    files = dist.broadcast_obj(_manifest_of(here) if dist.rank == src else None, src)
    with atomic_dir(target, replace=True) if receive else contextlib.nullcontext() as tmp:
        for rel, size, digest in files:
            h = xxhash.xxh3_64()
            if receive:  # a checkpoint has subfolders (trainer/)
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            out = open(tmp / rel, "wb") if receive else None  # noqa: SIM115 - closed below
            src_f = open(here / rel, "rb") if dist.rank == src else None  # noqa: SIM115
            try:
                for off in range(0, size, CHUNK):
                    n = min(CHUNK, size - off)
                    data = dist.broadcast_bytes(src_f.read(n) if src_f else None, n, src)
                    if out is not None:
                        h.update(data)
                        out.write(data)
            finally:
                for fh in (out, src_f):
                    if fh is not None:
                        fh.close()
            if receive and h.hexdigest() != digest:
                raise DflashError(
                    f"train rank {dist.rank}: checkpoint file {rel} received from rank {src} fails its "
                    f"digest (xxh3 {h.hexdigest()} against {digest}): nothing was written; rerun the trainer"
                )


def newest_everywhere(dist, out: Path, own_copy: bool) -> Path | None:
    """The newest checkpoint of any rank, in ``out`` on every rank once this returns (collective);
    None when no rank has one."""
    here = ckpt.latest_checkpoint(out)
    seen = dist.gather_obj((_step(here), own_copy))
    newest = max(s for s, _ in seen)
    if newest < 0 or all(s == newest for s, _ in seen):
        return here
    src = min(r for r, (s, _) in enumerate(seen) if s == newest)
    behind = [r for r, (s, own) in enumerate(seen) if s < newest and own]
    name = f"step_{newest:08d}"
    if dist.rank == 0:
        print(
            f"train: rank(s) {', '.join(map(str, behind))} lack checkpoint {name} (they hold "
            + ", ".join(f"rank {r}: {f'step_{s:08d}' if s >= 0 else 'none'}" for r, (s, _) in enumerate(seen))
            + f"): rank {src} sends it",
            file=sys.stderr,
            flush=True,
        )
    _send_or_receive(dist, src, dist.rank in behind, here, ckpt.checkpoints_dir(out) / name)
    dist.barrier()  # every copy is durable before anyone reads it
    got = ckpt.latest_checkpoint(out)
    agree = dist.gather_obj(_step(got))
    if len(set(agree)) > 1:
        raise DflashError(
            f"the ranks still see different newest checkpoints in {out} after catching up ("
            + ", ".join(f"rank {r}: {s}" for r, s in enumerate(agree))
            + "): a rank without its own copy reads another node's --out; give every node its own --out "
            "or one shared directory"
        )
    return got


def record_reformation(t) -> None:
    """Rank 0 of a live run resumed on other ranks (or restarted by torchrun's elastic agent) records it
    as a manifest event ``reform`` (``dflash status`` shows them): when, from which step, the ranks and
    nodes before and after."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if t.opts.replay or t.dist.rank != 0 or (t.reformed_from is None and not restarts):
        return
    world, nodes = t.reformed_from or (t.dist.world, t.nodes)
    before, after = sorted(set(nodes or [])), sorted(set(t.nodes))
    detail = {
        "step": t.step,
        "ranks": [world, t.dist.world],
        "left": sorted(set(before) - set(after)),
        "came": sorted(set(after) - set(before)),
        "nodes": after,
        "restart": restarts,
    }
    t.m.log_event("reform", json.dumps(detail))
