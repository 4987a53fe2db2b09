"""The ``dflash`` command line: plan, data show, status, extract, train, eval, regenerate, plot,
and the launchers pipeline (one host) and node (one GPU node).

Each command is a thin wrapper; the work lives in the module named after it.
User errors (:class:`dflash_staged.errors.DflashError`) print one clean line and exit 1.
"""

from __future__ import annotations

from pathlib import Path
import sys

import click

from dflash_staged.errors import DflashError, user_errors  # noqa: F401
from dflash_staged.sizes import ByteSize


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-staged")
def main() -> None:
    """Train DFlash drafters with a disk-staged pipeline: plan -> extract | train -> eval."""


# --- commands are added below, one block per command -------------------------------------

MANIFEST_HELP = "Manifest: a directory (SQLite, one host) or postgresql://USER@HOST:PORT/DB#NAME (many hosts)."


@main.command("plan")
@click.option("--config", "config_path", required=True, help="Config TOML, e.g. configs/tiny.toml.")
@click.option("--data", "data_path", required=True,
              help="JSONL (input_ids/loss_mask, messages or conversations), parquet, or a saved dataset directory.")
@click.option("--manifest", "manifest_dir", default=None,
              help=MANIFEST_HELP + " [default: manifests/<config stem>]")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True, help="Epochs to plan.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the job order.")
@click.option("--skip-bad", is_flag=True, help="Count and skip bad records instead of stopping at the first.")
@user_errors
def plan_cmd(config_path, data_path, manifest_dir, epochs, seed, skip_bad):
    """Tokenise the data, bucket and batch it, and write the job manifest."""
    from dflash_staged.plan.command import plan_manifest
    click.echo(plan_manifest(config_path, data_path, manifest_dir, epochs=epochs, seed=seed, skip_bad=skip_bad,
                             progress=True))


@main.group("data")
def data_group() -> None:
    """Look at training data the way `dflash plan` reads it."""


@data_group.command("show")
@click.option("--config", "config_path", required=True, help="Config TOML: the tokenizer, chat template and [data].")
@click.option("--data", "data_path", required=True, help="The data, as for `dflash plan --data`.")
@click.option("-n", "--num", type=click.IntRange(min=0), default=3, show_default=True, help="Show the first N samples.")
@click.option("--line", "--row", "lines", type=click.IntRange(min=1), multiple=True,
              help="Show the sample of this line (JSONL) or row instead; repeatable.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), default=None,
              help="Write an HTML page with the loss tokens highlighted.")
@click.option("--color/--no-color", default=None, help="Colour the loss tokens [default: when on a terminal].")
@click.option("--skip-bad", is_flag=True, help="Count and skip bad records instead of stopping at the first.")
@user_errors
def data_show(config_path, data_path, num, lines, html_path, color, skip_bad):
    """Render samples as plan would, mark the tokens that carry the loss, and report loss fraction and lengths."""
    from dflash_staged.plan.show import format_html, format_text, summary_lines, show_data
    report = show_data(config_path, data_path, num=num, lines=list(lines), skip_bad=skip_bad, progress=True)
    if html_path:
        from dflash_staged.fsutil import atomic_write
        atomic_write(html_path, format_html(report))
        click.echo("\n".join(summary_lines(report) + [f"wrote {html_path} ({len(report['samples'])} sample(s))"]))
        return
    color = sys.stdout.isatty() if color is None else color
    click.echo(format_text(report, color), color=color)


@main.command("status")
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with --jobs: a JSON array of jobs).")
@click.option("--jobs", "list_jobs", is_flag=True, help="List every job: id, epoch, bucket, sample_ids, state.")
@user_errors
def status_cmd(manifest_dir, as_json, list_jobs):
    """Show job states, the window and progress of a manifest."""
    import json
    from dflash_staged.manifest import Manifest
    from dflash_staged.manifest.status import format_status
    with Manifest.open(manifest_dir, readonly=True) as m:
        if list_jobs:
            jobs = [{"id": j.id, "epoch": j.epoch, "pos": j.pos, "bucket": j.bucket, "sample_ids": j.sample_ids,
                     "state": j.state, "real_tokens": j.real_tokens, "padded_tokens": j.padded_tokens}
                    for j in m.jobs()]
            if as_json:
                click.echo(json.dumps(jobs))
            else:
                click.echo(f"{'id':>8} {'epoch':>5} {'pos':>7} {'bucket':>6} {'samples':>7}  state")
                for j in jobs:
                    click.echo(f"{j['id']:>8} {j['epoch']:>5} {j['pos']:>7} {j['bucket']:>6} "
                               f"{len(j['sample_ids']):>7}  {j['state']}")
        else:
            st = m.status()
            click.echo(json.dumps(st) if as_json else format_status(st))


@main.command()
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option("--store", "store_dir", required=True, type=click.Path(path_type=Path), help="Shard store (zarr) on NVMe.")
@click.option("--devices", default="cpu", show_default=True, help="One worker per device: cuda:0,cuda:1 or cpu,cpu.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Devices per worker: each group of TP consecutive --devices holds one tensor-parallel target.")
@click.option("--window", type=click.IntRange(min=1), default=None,
              help="Max shards claimed/written/consumed but not released.")
@click.option("--window-bytes", type=ByteSize(zero="no limit"), default=None,
              help="Max bytes in the window, e.g. 200G; 0 = no limit [default: extract.window_bytes].")
@click.option("--train-ranks", type=click.IntRange(min=1), default=1, show_default=True,
              help="Trainer ranks, for the window check.")
@click.option("--allow-slow-kernels", is_flag=True, help="Run a hybrid target on CUDA without fla/causal-conv1d.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
              help="Override target.dtype (CPU only; CUDA uses bf16 by default).")
@click.option("--trainer-coming", is_flag=True, hidden=True,
              help="A launcher starts `dflash train` beside it: wait longer for it to register.")
@user_errors
def extract(manifest_dir, store_dir, devices, tp, window, window_bytes, train_ranks, allow_slow_kernels,
            dtype, trainer_coming):
    """Run target workers that write hidden-state shards for the manifest's jobs."""
    from dflash_staged.extract.options import options_from
    from dflash_staged.extract.supervisor import run_extract
    from dflash_staged.manifest import Manifest
    with Manifest.open(manifest_dir) as m:
        cfg = m.config
    opts = options_from(manifest_dir, store_dir, devices, cfg.extract, window=window,
                        window_bytes=window_bytes,
                        allow_slow_kernels=allow_slow_kernels, dtype=dtype, train_ranks=train_ranks, tp=tp,
                        trainer_coming=trainer_coming)
    sys.exit(run_extract(opts))


@main.command()
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option("--store", "store_dir", required=True, type=click.Path(path_type=Path), help="Shard store written by extract.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Run directory (checkpoints, metrics).")
@click.option("--replay", is_flag=True, help="Train offline from kept shards: no tailing, no manifest writes.")
@click.option("--keep-shards", is_flag=True, help="Keep consumed shards on disk (state kept) for later replays.")
@click.option("--order-from", type=click.Path(path_type=Path), default=None,
              help="With --replay: repeat the exact step order recorded in that run directory.")
@click.option("--passes", type=int, default=1, show_default=True, help="With --replay: passes over the kept shards.")
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a train (and, with --replay, drafter) setting, e.g. --set train.lr=1e-3.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--no-verify", is_flag=True, help="Skip shard checksum verification on read.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop (with a checkpoint) once this many steps are done; the schedule is unchanged.")
@click.option("--total-steps", type=click.IntRange(min=1), default=None,
              help="The learning-rate (and noise) schedule's length [default: one pass over the data].")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Trainer ranks: relaunch under torchrun (DDP).")
@click.option("--tensorboard", is_flag=True, help="Also log to RUN_DIR/tensorboard.")
@click.option("--init-from", type=click.Path(path_type=Path), default=None,
              help="Start a new run from this run's (newest) or checkpoint's drafter weights, e.g. a live run.")
@user_errors
def train(manifest_dir, store_dir, out_dir, replay, keep_shards, order_from, passes, sets, device, no_verify,
          max_steps, total_steps, nproc, tensorboard, init_from):
    """Train the drafter from the shards extract writes (or replay a kept store).

    With --nproc N this process becomes torchrun (exec: the same pid) and its N ranks die with it,
    even by ``kill -9`` (torchrun starts each rank in its own session: see :func:`die_with_torchrun`)."""
    import os
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dflash_staged"] + without_option(sys.argv[1:], "--nproc")
        os.environ[TORCHRUN_PID] = str(os.getpid())
        os.execv(sys.executable, cmd)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_torchrun()
    if order_from and not replay:
        raise DflashError("--order-from needs --replay")
    from dflash_staged.train.loop import train_loop
    from dflash_staged.train.options import TrainOptions
    from dflash_staged.train.trainer import build_trainer
    opts = TrainOptions(manifest=manifest_dir, store=store_dir, out=out_dir, replay=replay, keep_shards=keep_shards,
                        order_from=order_from, passes=passes, overrides=parse_sets(sets), device=device,
                        verify=not no_verify, max_steps=max_steps, total_steps=total_steps, tensorboard=tensorboard,
                        init_from=init_from)
    trainer = build_trainer(opts)
    try:
        code = train_loop(trainer)
    finally:
        trainer.close()
    sys.exit(code)


TORCHRUN_PID = "DFLASH_TORCHRUN_PID"  # set by `dflash train --nproc` for its ranks: the pid torchrun runs as


def die_with_torchrun() -> None:
    """A rank under torchrun: SIGKILL it when torchrun dies (torchrun starts each rank in its own
    session, so a ``kill -9`` of torchrun left the ranks training as orphans that hold the manifest).
    A rank whose torchrun died before the request took effect stops at once."""
    import os
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


@main.command("eval")
@click.option("--drafter", "drafter_path", required=True, type=click.Path(path_type=Path),
              help="Drafter checkpoint (config.json + model.safetensors) or a run directory (its newest).")
@click.option("--target", "target_spec", required=True,
              help="Target: model directory, hub id or tiny:qwen3; or a dflash config TOML (its [target]).")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path),
              help="JSONL: {\"messages\": [...]} (chat template + generation prompt) or {\"input_ids\": [...]}.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="New tokens per prompt; 2048 is the reference benchmark's (see dflash_staged/evaluate/report.py).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--no-baseline", is_flag=True, help="Skip plain greedy decoding (no tokens/s comparison).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tau_per_prompt_mean, tau_pooled = tau).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None,
              help="Write a PNG: accepted-length histogram and per-position acceptance.")
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
@click.option("--chat-template-kwargs", "chat_kwargs", default=None, metavar="JSON",
              help="Update the chat template's options recorded at training, e.g. '{\"enable_thinking\": true}'.")
@click.option("--chat-template", "chat_template", type=click.Path(path_type=Path), default=None,
              help="A Jinja chat template file replacing the recorded (or the tokenizer's) template.")
@user_errors
def eval_cmd(drafter_path, target_spec, prompts_path, max_new_tokens, limit, device, no_baseline, as_json,
             plot_path, out_path, chat_kwargs, chat_template):
    """Greedy speculative decoding with the target: acceptance length tau, tokens/s vs plain greedy."""
    import json
    from dflash_staged.evaluate.report import format_report, run_eval
    from dflash_staged.fsutil import write_json_atomic
    kwargs = parse_json_object(chat_kwargs, "--chat-template-kwargs")
    report = run_eval(drafter_path, target_spec, prompts_path, max_new_tokens, device=device, limit=limit,
                      baseline=not no_baseline, chat_template_kwargs=kwargs, chat_template=chat_template)
    if plot_path:
        from dflash_staged.evaluate.plot import plot_eval
        report["plot"] = str(plot_eval(report, plot_path))
    if out_path:
        write_json_atomic(out_path, report)
    click.echo(json.dumps(report) if as_json else format_report(report))


@main.command()
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path),
              help="JSONL conversations ({\"messages\": [...]}); assistant turns are replaced.")
@click.option("--target", "target_spec", required=True,
              help="Target: model directory, hub id or tiny:qwen3; or a dflash config TOML (its [target]).")
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), help="Output JSONL.")
@click.option("--devices", default="cpu", show_default=True, help="One worker per device: cuda:0,cuda:1 or cpu,cpu.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Length cap of each answer.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 = greedy; > 0 samples.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the sampling.")
@click.option("--chat-template-kwargs", "chat_kwargs", default=None, metavar="JSON",
              help="Options of the chat template, e.g. '{\"enable_thinking\": false}' (over a TOML target's [data]).")
@click.option("--chat-template", "chat_template", type=click.Path(path_type=Path), default=None,
              help="A Jinja chat template file replacing the tokenizer's (or the TOML's [data] one).")
@user_errors
def regenerate(prompts_path, target_spec, out_path, devices, max_new_tokens, temperature, top_p, batch_size, seed,
               chat_kwargs, chat_template):
    """Answer every conversation with the target itself: the data DFlash trains on (resumable).

    With a config TOML as --target, its [data] chat options apply, so the answers are rendered the
    way `dflash plan` will render them."""
    from dflash_staged.config import load_config, target_from_spec
    from dflash_staged.extract.options import parse_devices
    from dflash_staged.chat import ChatOptions
    from dflash_staged.regenerate.command import run_regenerate
    from dflash_staged.regenerate.worker import GenOptions
    chat = ChatOptions.from_config(load_config(target_spec).data) if target_spec.endswith(".toml") else ChatOptions()
    chat.override(parse_json_object(chat_kwargs, "--chat-template-kwargs"), chat_template)
    o = GenOptions(target=target_from_spec(target_spec), out=out_path, devices=parse_devices(devices),
                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=chat)
    run_regenerate(prompts_path, o, batch_size=batch_size)


@main.command("plot")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=None,
              help="PNG to write [default: RUN_DIR/metrics.png].")
@user_errors
def plot_cmd(run_dir, out_path):
    """Draw a run's training curves (loss, training tau, learning rate) from its metrics.jsonl."""
    from dflash_staged.train.curves import plot_metrics
    click.echo(str(plot_metrics(run_dir, out_path)))


def parse_sets(sets) -> dict:
    """['train.lr=1e-3', 'drafter.block_size=8'] -> {'train': {'lr': 0.001}, 'drafter': {'block_size': 8}}."""
    from dflash_staged.config import tomllib
    out: dict = {}
    for s in sets:
        key, sep, value = s.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise DflashError(f"--set {s!r}: use SECTION.KEY=VALUE, e.g. --set train.lr=1e-3")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        out.setdefault(section, {})[name] = parsed
    return out


def parse_json_object(text: str | None, flag: str) -> dict | None:
    """``'{"enable_thinking": true}'`` -> a dict (None stays None)."""
    import json
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DflashError(f"{flag} {text!r}: not JSON ({e.msg}); give an object, e.g. "
                          "'{\"enable_thinking\": false}'") from None
    if not isinstance(obj, dict):
        raise DflashError(f"{flag} {text!r}: give a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return obj


def _register_launchers() -> None:
    from dflash_staged.launch.commands import node, pipeline
    main.add_command(pipeline)
    main.add_command(node)


_register_launchers()

if __name__ == "__main__":  # pragma: no cover
    main()
