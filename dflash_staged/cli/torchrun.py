"""``dflash train --nproc N`` under torchrun: the relaunch (this process becomes torchrun, the same pid)
and the ranks' lifetime (each rank dies with torchrun, even by ``kill -9``)."""

from __future__ import annotations

import os
import sys

import click

TORCHRUN_PID = "DFLASH_TORCHRUN_PID"  # set by `dflash train --nproc` for its ranks: the pid torchrun runs as


def become_torchrun(nproc: int, launch: list[str] | None = None) -> None:
    """Replace this process (exec: the same pid) by torchrun running ``nproc`` ranks of this command line
    without its ``--nproc`` (and elastic options); the ranks learn torchrun's pid from
    :data:`TORCHRUN_PID`. ``launch``: torchrun's arguments (an elastic job's), else a standalone job."""
    args = sys.argv[1:]
    for name in ("--nproc", "--nnodes", "--max-restarts", "--rdzv-endpoint"):
        args = without_option(args, name)
    launch = launch or ["--standalone", f"--nproc-per-node={nproc}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "dflash_staged", *args]
    os.environ[TORCHRUN_PID] = str(os.getpid())
    os.execv(sys.executable, cmd)


def die_with_torchrun() -> None:
    """A rank under torchrun: SIGKILL it when torchrun dies (torchrun starts each rank in its own
    session, so a ``kill -9`` of torchrun left the ranks training as orphans that hold the manifest).
    A rank whose torchrun died before the request took effect stops at once."""
    import signal

    from dflash_staged.procs import die_with_parent

    torchrun = int(os.environ.get(TORCHRUN_PID, "0") or 0) or os.getppid()
    if not die_with_parent(signal.SIGKILL, parent=torchrun):
        click.echo(f"train: torchrun (pid {torchrun}) exited before this rank started; stopping", err=True)
        sys.exit(1)


def without_option(args: list[str], name: str) -> list[str]:
    """``args`` without the option ``name`` and its value, spelled ``--name V`` or ``--name=V``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
