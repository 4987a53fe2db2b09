"""``dflash pipeline`` and ``dflash node``: plan if needed, then extract and train side by side.

``bin/pipeline`` and ``bin/node`` are thin wrappers over these two commands. ``dflash node --split
auto`` measures the node before choosing its split: :mod:`dflash_staged.launch.probe`. The layouts and
the probe are imported when a command runs, so that ``--help`` imports nothing heavy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_staged.errors import user_errors
from dflash_staged.sizes import ByteSize

PROBE_JOBS = 8  # jobs the extract probe of --split auto writes (--probe-jobs)


def _common(fn):
    opts = [
        click.option(
            "--config",
            "config",
            required=True,
            type=click.Path(path_type=Path),
            help="Config TOML (planned into WORKDIR/manifest unless that holds this plan already).",
        ),
        click.option(
            "--data",
            "data",
            required=True,
            type=click.Path(path_type=Path),
            help="Data to plan: JSONL, parquet or a saved dataset (as for dflash plan).",
        ),
        click.option(
            "--workdir",
            required=True,
            type=click.Path(path_type=Path),
            help="Holds manifest/, store/ (shards; put it on NVMe) and run/ (checkpoints, metrics).",
        ),
        click.option(
            "--manifest",
            default=None,
            help="Manifest address instead of WORKDIR/manifest, e.g. postgresql://USER@HOST:PORT/DB#NAME.",
        ),
        click.option(
            "--epochs",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Epochs to plan (as for dflash plan).",
        ),
        click.option(
            "--seed",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Seed of the job order (as for dflash plan).",
        ),
        click.option(
            "--window",
            type=click.IntRange(min=1),
            default=None,
            help="Shards claimed/written/consumed but not released [default: extract.window].",
        ),
        click.option(
            "--window-bytes",
            type=ByteSize(zero="no limit"),
            default=None,
            help="Byte cap of the window, e.g. 200G; 0 = no limit [default: extract.window_bytes].",
        ),
        click.option("--keep-shards", is_flag=True, help="Keep consumed shards for later `train --replay`."),
        click.option(
            "--allow-slow-kernels", is_flag=True, help="Hybrid target on CUDA without fla/causal-conv1d."
        ),
        click.option(
            "--tp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Extract devices per worker: a tensor-parallel target over each group of TP.",
        ),
        click.option(
            "--status-every",
            type=float,
            default=10.0,
            show_default=True,
            help="Seconds between combined status lines.",
        ),
        click.option(
            "--summary-json",
            type=click.Path(path_type=Path),
            default=None,
            help="Also write the final summary as JSON here.",
        ),
        click.option(
            "--dry-run", is_flag=True, help="Print the processes it would start (commands + env); start none."
        ),
        click.argument("train_args", nargs=-1, type=click.UNPROCESSED),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _run_layout(layout, status_every: float, summary_json: Path | None, dry_run: bool) -> int:
    if dry_run:
        if layout.plan_cmd is None:
            print(f"[dry-run] plan: skipped ({layout.manifest} already holds this plan)", flush=True)
        for line in layout.disk_notes() if layout.disk_notes else []:
            print(f"[dry-run] {line}", flush=True)
    after = None
    if layout.disk_notes and not dry_run:

        def after():
            try:
                lines = layout.disk_notes()
            except Exception as e:  # noqa: BLE001 - the arithmetic is advice; never block the run on it
                lines = [f"disk arithmetic unavailable: {type(e).__name__}: {e}"]
            for line in lines:
                click.echo(f"[launch] {line}")

    if not dry_run and layout.plan_cmd is None:
        click.echo(f"[launch] {layout.manifest} already holds this plan; not re-planning")
    from dflash_staged.launch.supervise import run_side_by_side

    return run_side_by_side(
        layout.plan_cmd,
        layout.extract.cmd,
        layout.train.cmd,
        layout.extract.env,
        layout.train.env,
        manifest=layout.manifest,
        store=layout.store,
        run_dir=layout.run_dir,
        status_every=status_every,
        summary_path=summary_json,
        after_plan=after,
        dry_run=dry_run,
    )


_CTX = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


def _launch(layout_of, o: dict) -> None:
    """Build the layout from the command's options (named as ``layout_of``'s parameters), run it, exit."""
    from dflash_staged.preflight import writable_dir

    run = {k: o.pop(k) for k in ("status_every", "summary_json", "dry_run")}
    writable_dir(o["workdir"], "--workdir")  # one line before anything starts, not a child's traceback
    layout = layout_of(o.pop("config"), o.pop("data"), o.pop("workdir"), **o)
    sys.exit(_run_layout(layout, **run))


@click.command(context_settings=_CTX, short_help="Plan, then extract and train side by side on one host.")
@_common
@click.option(
    "--devices", default="cpu", show_default=True, help="Extract workers: cpu, cpu,cpu or cuda:0,..."
)
@user_errors
def pipeline(**o):
    """One host: plan if needed, then extract on --devices and train, side by side.

    Arguments after the options (e.g. -- --max-steps 100 --set train.lr=1e-3) go to dflash train.
    """
    from dflash_staged.launch.processes import pipeline_layout

    _launch(pipeline_layout, o)


@click.command(context_settings=_CTX, short_help="Plan, then extract and train side by side on a GPU node.")
@_common
@click.option(
    "--extract-gpus",
    default=None,
    help="GPUs running the target, one extract worker each (with --tp N: each N): 0,1,2,3 or 0-3.",
)
@click.option(
    "--train-gpus", default=None, help="GPUs training the drafter (torchrun ranks): 4,5,6,7 or 4-7."
)
@click.option(
    "--split",
    type=click.Choice(["auto"]),
    default=None,
    help="Instead of --extract-gpus/--train-gpus: measure one extract worker and one trainer rank on "
    "this node (real jobs of the plan), then split --devices for the most throughput (docs/gpu.md); "
    "with --dry-run it still plans and measures, then prints the commands.",
)
@click.option(
    "--devices",
    default=None,
    help="With --split auto: the node's devices, GPU ids (0-7) or cpu,cpu,... [default: every visible GPU].",
)
@click.option(
    "--probe-jobs",
    type=click.IntRange(min=2),
    default=PROBE_JOBS,
    show_default=True,
    help="With --split auto: jobs the extract probe writes (they are jobs of the run).",
)
@click.option(
    "--train-scaling",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=1.0,
    show_default=True,
    help="With --split auto: data-parallel efficiency of several trainer ranks (1 = linear).",
)
@click.option(
    "--target-tok-s",
    type=float,
    default=None,
    help="Assumed extract tokens/s per extract worker (one GPU, or one group of --tp GPUs), for the "
    "disk bandwidth it prints [default: the rate --split auto measures, else 8000, an 8B dense target "
    "in bf16 on an H100-class GPU].",
)
@click.option(
    "--hidden-size",
    type=click.IntRange(min=1),
    default=None,
    help="Target hidden size, when it cannot be read offline.",
)
@click.option(
    "--nnodes",
    default="1",
    show_default=True,
    help="Nodes of the run (torchrun's): N, or MIN:MAX for an elastic job that re-forms when nodes "
    "leave or come (with --max-restarts; docs/multinode.md).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Elastic: the trainer's restarts (each node lost spends one; a node arriving none).",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="This node's rank (0 plans).",
)
@click.option("--master-addr", default=None, help="With --nnodes > 1: node 0's address (torchrun's).")
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=29500,
    show_default=True,
    help="With --nnodes > 1: the port of node 0's rendezvous (torchrun's).",
)
@click.option(
    "--node-local",
    is_flag=True,
    help="A store per node (WORKDIR/store on its NVMe): its ranks train on its own shards "
    "(docs/multinode.md).",
)
@user_errors
def node(**o):
    """One GPU node: plan if needed, then extract and train (under torchrun) side by side.

    \b
    Give the split, or let the node measure it:
      --extract-gpus 0-3 --train-gpus 4-7   extract on 0-3, train on 4-7
      --split auto                          measure both here, then choose

    Arguments after the options (e.g. -- --max-steps 100) go to dflash train.
    """
    from dflash_staged.launch.elastic import parse_nnodes
    from dflash_staged.launch.probe import auto_node_layout
    from dflash_staged.launch.processes import DEFAULT_TARGET_TOK_S, node_layout

    o["nnodes_min"], o["nnodes"] = parse_nnodes(o["nnodes"])
    split, devices = o.pop("split"), o.pop("devices")
    probe_jobs, scaling = o.pop("probe_jobs"), o.pop("train_scaling")
    if split is None:
        if devices is not None:
            raise click.UsageError("--devices names the devices --split auto splits; add --split auto")
        if not (o["extract_gpus"] and o["train_gpus"]):
            raise click.UsageError(
                "give --extract-gpus and --train-gpus, or --split auto to measure and choose them"
            )
        o["target_tok_s"] = o["target_tok_s"] or DEFAULT_TARGET_TOK_S
        _launch(node_layout, o)
    extract_gpus, train_gpus = o.pop("extract_gpus"), o.pop("train_gpus")
    if extract_gpus or train_gpus:
        raise click.UsageError(
            "--split auto chooses the extract and train GPUs: give the node's with --devices, not "
            "--extract-gpus/--train-gpus"
        )
    run = {k: o.pop(k) for k in ("status_every", "summary_json", "dry_run")}
    sys.exit(_run_layout(auto_node_layout(o, devices, probe_jobs, scaling), **run))
