"""Resumable, crash-safe output of ``dflash regenerate``.

While a run is in progress its results live in ``OUT.parts/``, one append-only JSONL file per
worker process (``w<rank>-<pid>.jsonl``). A worker appends a whole batch of records and fsyncs
the file before it takes the next batch; each record names the input line it answers
(``regenerated.line``). On (re)start, every part file is read: a last line without its newline
(a worker killed mid-write) is cut off, and the input lines already answered are skipped, so a
restarted run continues where it stopped and never answers a line twice. When every line is
answered the records are written to ``OUT`` in input order with
:func:`dflash_staged.fsutil.atomic_write` and ``OUT.parts/`` is removed; ``OUT`` therefore
exists only complete.

**One run per OUT** (:func:`exclusive`): a run holds an exclusive ``flock`` on ``OUT.lock`` from before it
reads the part files (whose torn last lines it cuts) until it has written ``OUT``; a second run on the
same ``OUT`` is refused with one line naming the first's pid, before it touches anything. The kernel
drops the lock when its holder dies, ``kill -9`` included, so a rerun after a crash is never refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_write, fsync_dir


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


@contextlib.contextmanager
def exclusive(out: Path):
    """Hold ``OUT.lock`` for the run (module docstring); the lock file is removed when the run ends."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DflashError(
                f"--out {out}: another dflash regenerate (pid {holder}) is writing it; wait for that run to "
                f"end or choose another --out (the lock is {path})"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the run before us removed the file between our open and our lock: try again
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def load_done(out: Path) -> dict[int, dict]:
    """Input line -> its record, from the part files (each torn last line cut off the file)."""
    done: dict[int, dict] = {}
    d = parts_dir(out)
    if not d.is_dir():
        return done
    for f in sorted(d.glob("*.jsonl")):
        data = f.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn append: drop it for good, so later appends start on a line
            with open(f, "r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())
        for no, raw in enumerate(data[:end].splitlines(), 1):
            try:
                rec = json.loads(raw)
                line = int(rec["regenerated"]["line"])
            except (ValueError, KeyError, TypeError):
                raise DflashError(f"{f}:{no}: not a regenerate record; delete {d} to start over") from None
            done.setdefault(line, rec)
    return done


class PartWriter:
    """One worker's append-only part file."""

    def __init__(self, out: Path, rank: int):
        d = parts_dir(out)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"w{rank}-{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        fsync_dir(d)

    def append(self, records: list[dict]) -> None:
        """Write the records as whole lines, then fsync: durable before the next batch is taken."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def finish(out: Path, lines: list[int], done: dict[int, dict]) -> None:
    """All ``lines`` answered: write OUT in input order atomically, then drop the parts."""
    missing = [n for n in lines if n not in done]
    if missing:
        raise DflashError(
            f"{out}: {len(missing)} conversation(s) still unanswered (lines {missing[:10]}); "
            "rerun the same command to finish"
        )
    atomic_write(out, "".join(json.dumps(done[n], ensure_ascii=False) + "\n" for n in lines))
    shutil.rmtree(parts_dir(out), ignore_errors=True)
