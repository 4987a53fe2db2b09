"""Checks every command makes before any expensive work (loading a target, decoding prompts, training):
that the paths it will write can be written, that a path it reads is what it should be, and that the
device it was given exists here. Each failure is one :class:`~dflash_staged.errors.DflashError` line
naming the flag, the path or device, and the fix; a check writes nothing it leaves behind (a probe file
in the nearest existing folder, removed at once), so a refused command leaves no empty folder.

OS errors met later get the same wording from the CLI's error boundary
(:func:`dflash_staged.errors.user_errors`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dflash_staged.errors import DflashError, os_error_line


def writable_dir(path: str | os.PathLike, flag: str) -> Path:
    """Check that ``path`` is (or can be created as) a folder this process can write in; create nothing.

    Refuses a path that is a file, one under a file, and one on a read-only, full or forbidden disk."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise DflashError(f"{flag} {path}: it is a file, not a folder; give a folder (new or existing)")
    probe_in = p
    while not probe_in.exists():
        if probe_in.parent == probe_in:
            break
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise DflashError(f"{flag} {path}: {probe_in} is a file, not a folder; choose another path")
    try:
        fd, name = tempfile.mkstemp(prefix=".dflash-probe-", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        line = os_error_line(OSError(e.errno, f"cannot write in {probe_in} ({e.strerror})", str(path)), flag)
        raise DflashError(line or f"{flag} {path}: cannot write in {probe_in} ({e})") from None
    return p


def writable_file(path: str | os.PathLike, flag: str) -> Path:
    """Check that file ``path`` can be written (its folder can be, and it is not a folder); create nothing."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DflashError(f"{flag} {path}: it is a folder; give a file name (e.g. {p / 'out.json'})")
    writable_dir(p.parent, flag)
    return p


def existing_dir(path: str | os.PathLike, flag: str) -> Path:
    """A folder that must be a folder if it exists (a store or run another command fills)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise DflashError(f"{flag} {path}: it is a file, not a folder; give the folder another command fills")
    return p


def device(spec: str | None, flag: str = "--device") -> str | None:
    """Check a ``--device`` value (None: the command's default): a device torch knows, present here."""
    if spec is None:
        return None
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise DflashError(f"{flag} {spec}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise DflashError(f"{flag} {spec}: this command runs on cpu or cuda; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DflashError(f"{flag} {spec}: CUDA is not available on this machine; use {flag} cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DflashError(
                f"{flag} {spec}: this machine shows {n} GPU(s) (cuda:0..cuda:{n - 1}, after "
                "CUDA_VISIBLE_DEVICES); pick one that exists"
            )
    return spec
