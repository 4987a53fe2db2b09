"""The pipeline's stages: ``dflash extract`` and ``dflash train`` (``--nproc``: see
:mod:`dflash_staged.cli.torchrun`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_staged.cli.options import MANIFEST_HELP, parse_sets
from dflash_staged.cli.torchrun import become_torchrun, die_with_torchrun
from dflash_staged.errors import DflashError, user_errors
from dflash_staged.sizes import ByteSize


@click.command(short_help="Run the target and write hidden-state shards for the jobs.")
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option(
    "--store", "store_dir", required=True, type=click.Path(path_type=Path), help="Shard store (zarr) on NVMe."
)
@click.option(
    "--devices", default="cpu", show_default=True, help="One worker per device: cuda:0,cuda:1 or cpu,cpu."
)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Devices per worker: each group of TP consecutive --devices holds one tensor-parallel target.",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=None,
    help="Max shards claimed/written/consumed but not released.",
)
@click.option(
    "--window-bytes",
    type=ByteSize(zero="no limit"),
    default=None,
    help="Max bytes in the window, e.g. 200G; 0 = no limit [default: extract.window_bytes].",
)
@click.option(
    "--train-ranks",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Trainer ranks, for the window check.",
)
@click.option(
    "--allow-slow-kernels", is_flag=True, help="Run a hybrid target on CUDA without fla/causal-conv1d."
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default=None,
    help="Override target.dtype (CPU only; CUDA uses bf16 by default).",
)
@click.option(
    "--node-local",
    is_flag=True,
    help="A store per node (its NVMe): windows per node, ranks train on their node's shards "
    "(docs/multinode.md); every extract and train of the manifest runs with it.",
)
@click.option(
    "--trainer-coming",
    is_flag=True,
    hidden=True,
    help="A launcher starts `dflash train` beside it: wait longer for it to register.",
)
@user_errors
def extract(
    manifest_dir,
    store_dir,
    devices,
    tp,
    window,
    window_bytes,
    train_ranks,
    allow_slow_kernels,
    dtype,
    trainer_coming,
    node_local,
):
    """Run target workers that write hidden-state shards for the manifest's jobs."""
    from dflash_staged.extract.options import options_from
    from dflash_staged.extract.supervisor import run_extract
    from dflash_staged.manifest import Manifest

    with Manifest.open(manifest_dir) as m:
        cfg = m.config
    opts = options_from(
        manifest_dir,
        store_dir,
        devices,
        cfg.extract,
        window=window,
        window_bytes=window_bytes,
        allow_slow_kernels=allow_slow_kernels,
        dtype=dtype,
        train_ranks=train_ranks,
        tp=tp,
        trainer_coming=trainer_coming,
        node_local=node_local,
    )
    sys.exit(run_extract(opts))


@click.command(short_help="Train the drafter on the shards extract writes.")
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option(
    "--store",
    "store_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Shard store written by extract.",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Run directory (checkpoints, metrics).",
)
@click.option(
    "--replay", is_flag=True, help="Train offline from kept shards: no tailing, no manifest writes."
)
@click.option(
    "--keep-shards", is_flag=True, help="Keep consumed shards on disk (state kept) for later replays."
)
@click.option(
    "--order-from",
    type=click.Path(path_type=Path),
    default=None,
    help="With --replay: repeat the exact step order recorded in that run directory.",
)
@click.option(
    "--passes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --replay: passes over the kept shards.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override a train (and, with --replay, drafter) setting, e.g. --set train.lr=1e-3.",
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--no-verify", is_flag=True, help="Skip shard checksum verification on read.")
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop (with a checkpoint) once this many steps are done; the schedule is unchanged.",
)
@click.option(
    "--total-steps",
    type=click.IntRange(min=1),
    default=None,
    help="The learning-rate (and noise) schedule's length [default: one pass over the data].",
)
@click.option(
    "--time-budget-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop (with a checkpoint) after this many seconds of training, however many steps that is; the "
    "learning-rate schedule is refitted to the steps the time left affords, so it still ends at 0.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Trainer ranks: relaunch under torchrun (DDP).",
)
@click.option(
    "--nnodes",
    default="1",
    show_default=True,
    help="Nodes of an elastic trainer job, N or MIN:MAX: with --nproc this node's share runs under "
    "torchrun's elastic agent (docs/multinode.md).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restarts of an elastic job (each node lost spends one; a node arriving spends none).",
)
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of an elastic job's rendezvous (one node's).")
@click.option(
    "--node-local",
    is_flag=True,
    help="A store per node (its NVMe): windows per node, ranks train on their node's shards "
    "(docs/multinode.md); every extract and train of the manifest runs with it.",
)
@click.option("--tensorboard", is_flag=True, help="Also log to RUN_DIR/tensorboard.")
@click.option(
    "--init-from",
    type=click.Path(path_type=Path),
    default=None,
    help="Start a new run from this run's (newest) or checkpoint's drafter weights, e.g. a live run.",
)
@user_errors
def train(
    manifest_dir,
    store_dir,
    out_dir,
    replay,
    keep_shards,
    order_from,
    passes,
    sets,
    device,
    no_verify,
    max_steps,
    total_steps,
    time_budget_s,
    nproc,
    nnodes,
    max_restarts,
    rdzv_endpoint,
    tensorboard,
    init_from,
    node_local,
):
    """Train the drafter from the shards extract writes (or replay a kept store).

    With --nproc N this process becomes torchrun (the same pid), and its N ranks stop with it, even
    on kill -9.
    """
    # (torchrun starts each rank in its own session: dflash_staged.cli.torchrun.die_with_torchrun)
    import os

    if "WORLD_SIZE" not in os.environ:
        from dflash_staged.launch.elastic import (
            AGENT_ENV,
            check_elastic,
            is_elastic,
            parse_nnodes,
            torchrun_args,
        )

        nodes = parse_nnodes(nnodes)
        check_elastic(nodes, max_restarts, rdzv_endpoint, manifest_dir)
        if is_elastic(nodes, max_restarts):
            os.environ.update(AGENT_ENV)
            become_torchrun(nproc, torchrun_args(nodes, nproc, max_restarts, rdzv_endpoint, manifest_dir))
        elif nodes[1] > 1:
            raise DflashError(
                f"--nnodes {nnodes}: several nodes take torchrun (docs/multinode.md), or MIN:MAX"
            )
        if nproc > 1:
            become_torchrun(nproc)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_torchrun()
    if order_from and not replay:
        raise DflashError("--order-from needs --replay")
    from dflash_staged.train.loop import train_loop
    from dflash_staged.train.options import TrainOptions
    from dflash_staged.train.trainer import build_trainer

    opts = TrainOptions(
        manifest=manifest_dir,
        store=store_dir,
        out=out_dir,
        replay=replay,
        keep_shards=keep_shards,
        order_from=order_from,
        passes=passes,
        overrides=parse_sets(sets),
        device=device,
        verify=not no_verify,
        max_steps=max_steps,
        total_steps=total_steps,
        tensorboard=tensorboard,
        init_from=init_from,
        time_budget_s=time_budget_s,
        node_local=node_local,
    )
    trainer = build_trainer(opts)
    finished = False
    try:
        code = train_loop(trainer)
        finished = True
    finally:
        trainer.close(finished)
    sys.exit(code)
