"""The pipeline's stages: ``dflash extract``, ``dflash train`` (``--nproc``: see
:mod:`dflash_staged.cli.torchrun`) and ``dflash regenerate``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_staged.cli.options import MANIFEST_HELP, parse_json_object, parse_sets
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


@click.command(short_help="Answer the prompts with the target: the data to train on.")
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL conversations ({"messages": [...]}); assistant turns are replaced.',
)
@click.option(
    "--target",
    "target_spec",
    required=True,
    help="Target: model directory, hub id or tiny:qwen3; or a dflash config TOML (its [target]).",
)
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), help="Output JSONL.")
@click.option(
    "--devices", default="cpu", show_default=True, help="One worker per device: cuda:0,cuda:1 or cpu,cpu."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Length cap of each answer.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="0 = greedy; > 0 samples.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus sampling at --temperature > 0 (1 = off).",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Top-k sampling at --temperature > 0 (0 = off).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Conversations answered together in one batch (grouped by length).",
)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the sampling."
)
@click.option(
    "--chat-template-kwargs",
    "chat_kwargs",
    default=None,
    metavar="JSON",
    help="Options of the chat template, e.g. '{\"enable_thinking\": false}' (over a TOML target's [data]).",
)
@click.option(
    "--chat-template",
    "chat_template",
    type=click.Path(path_type=Path),
    default=None,
    help="A Jinja chat template file replacing the tokenizer's (or the TOML's [data] one).",
)
@click.option(
    "--server",
    "servers",
    default=None,
    metavar="URL[,URL...]",
    help="Answer through these OpenAI-compatible servers (vLLM, SGLang, llama-server) instead of "
    "in-process workers; conversations are spread across them.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="With --server: conversations in flight per server [default: llama-server's slots, SGLang's "
    "max running requests, else 64].",
)
@click.option(
    "--api-key-env",
    "api_key_env",
    default=None,
    metavar="NAME",
    help="With --server: the environment variable holding the servers' API key (never printed).",
)
@click.option(
    "--served-model",
    "served_model",
    default=None,
    metavar="NAME",
    help="With --server: the served model name to request, when the server names the target otherwise.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="With --server: tries of a request (429, 5xx, dropped connection) before its conversation is "
    "skipped.",
)
@click.option(
    "--server-wait",
    "server_wait",
    type=click.FloatRange(min=0.0),
    default=600.0,
    show_default=True,
    help="With --server: seconds a server that stopped answering (a restart) is waited for before its "
    "work goes to the others.",
)
@click.option(
    "--allow-skipped",
    is_flag=True,
    help="With --server: write the output without the conversations that kept failing (they are "
    "listed in OUT.skipped.jsonl).",
)
@user_errors
def regenerate(
    prompts_path,
    target_spec,
    out_path,
    devices,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    batch_size,
    seed,
    chat_kwargs,
    chat_template,
    servers,
    concurrency,
    api_key_env,
    served_model,
    max_attempts,
    server_wait,
    allow_skipped,
):
    """Answer every conversation with the target itself: the data DFlash trains on (resumable).

    With a config TOML as --target, its [data] chat options apply, so the answers are rendered the
    way `dflash plan` will render them.

    With --server, the conversations are answered by servers that already serve the target, for
    example:

    \b
      vllm serve Qwen/Qwen3-8B --port 8000
      python -m sglang.launch_server --model-path Qwen/Qwen3-8B --port 30000
      llama-server -m qwen3-8b.gguf --port 8080 -np 8 -c 32768

    Before any work each server must answer, serve the target (checked through /v1/models) and turn
    sampled prompts into the project's tokens. Answers are appended as they come, so a killed run or a
    restarted server loses nothing answered; rerun the same command to go on."""
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import load_config, target_from_spec
    from dflash_staged.extract.options import parse_devices
    from dflash_staged.regenerate.command import run_regenerate
    from dflash_staged.regenerate.options import GenOptions, ServerOptions

    chat = (
        ChatOptions.from_config(load_config(target_spec).data)
        if target_spec.endswith(".toml")
        else ChatOptions()
    )
    chat.override(parse_json_object(chat_kwargs, "--chat-template-kwargs"), chat_template)
    o = GenOptions(
        target=target_from_spec(target_spec),
        out=out_path,
        devices=parse_devices(devices),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        chat=chat,
    )
    server = None
    if servers:
        server = ServerOptions(
            urls=[u for u in servers.split(",") if u.strip()],
            concurrency=concurrency,
            api_key_env=api_key_env,
            served_model=served_model,
            max_attempts=max_attempts,
            server_wait_s=server_wait,
            allow_skipped=allow_skipped,
        )
    run_regenerate(prompts_path, o, batch_size=batch_size, server=server)
