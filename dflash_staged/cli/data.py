"""Commands on the data and its plan: ``dflash plan``, ``dflash data show``, ``dflash status``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_staged.cli.options import MANIFEST_HELP, InOrder
from dflash_staged.errors import user_errors


@click.command("plan", short_help="Tokenise and batch the data into a manifest of jobs.")
@click.option("--config", "config_path", required=True, help="Config TOML, e.g. configs/tiny.toml.")
@click.option(
    "--data",
    "data_path",
    required=True,
    help="JSONL (input_ids/loss_mask, messages or conversations), parquet, or a saved dataset directory.",
)
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True, help="Epochs to plan.")
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the job order."
)
@click.option("--skip-bad", is_flag=True, help="Count and skip bad records instead of stopping at the first.")
@user_errors
def plan_cmd(config_path, data_path, manifest_dir, epochs, seed, skip_bad):
    """Tokenise the data, bucket and batch it, and write the job manifest."""
    from dflash_staged.plan.command import plan_manifest

    click.echo(
        plan_manifest(
            config_path, data_path, manifest_dir, epochs=epochs, seed=seed, skip_bad=skip_bad, progress=True
        )
    )


@click.group("data", cls=InOrder)
def data_group() -> None:
    """Look at training data the way `dflash plan` reads it."""


@data_group.command("show", short_help="Render samples as plan would, with the loss tokens marked.")
@click.option(
    "--config", "config_path", required=True, help="Config TOML: the tokenizer, chat template and [data]."
)
@click.option("--data", "data_path", required=True, help="The data, as for `dflash plan --data`.")
@click.option(
    "-n", "--num", type=click.IntRange(min=0), default=3, show_default=True, help="Show the first N samples."
)
@click.option(
    "--line",
    "--row",
    "lines",
    type=click.IntRange(min=1),
    multiple=True,
    help="Show the sample of this line (JSONL) or row instead; repeatable.",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Write an HTML page with the loss tokens highlighted.",
)
@click.option(
    "--color/--no-color", default=None, help="Colour the loss tokens [default: when on a terminal]."
)
@click.option("--skip-bad", is_flag=True, help="Count and skip bad records instead of stopping at the first.")
@user_errors
def data_show(config_path, data_path, num, lines, html_path, color, skip_bad):
    """Render samples as plan would, mark the tokens that carry the loss, and report loss fraction
    and lengths."""
    from dflash_staged.plan.show import format_html, format_text, show_data, summary_lines

    report = show_data(config_path, data_path, num=num, lines=list(lines), skip_bad=skip_bad, progress=True)
    _past_the_end(data_path, report)
    if html_path:
        from dflash_staged.fsutil import atomic_write

        atomic_write(html_path, format_html(report))
        click.echo(
            "\n".join(summary_lines(report) + [f"wrote {html_path} ({len(report['samples'])} sample(s))"])
        )
        return
    color = sys.stdout.isatty() if color is None else color
    click.echo(format_text(report, color), color=color)


def _past_the_end(data_path, report: dict) -> None:
    """A ``--line`` beyond the data's last line (or row) is an error, not a sample left out."""
    from dflash_staged.errors import DflashError

    end = report["stats"]["last_record"]
    past = [n for n in report["not_found"] if n > end]
    if past:
        what = "line" if str(report["stats"]["format"]).split(",")[0].endswith("JSONL") else "row"
        whole = "the file" if Path(data_path).is_file() else "the data"
        raise DflashError(f"{data_path}: {what} {past[0]} is past the end ({whole} has {end} {what}s)")


@click.command("status", short_help="Show a manifest's jobs, window, progress and bottleneck.")
@click.option("--manifest", "manifest_dir", required=True, help=MANIFEST_HELP)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (with --jobs: a JSON array of jobs)."
)
@click.option(
    "--jobs", "list_jobs", is_flag=True, help="List every job: id, epoch, bucket, sample_ids, state."
)
@user_errors
def status_cmd(manifest_dir, as_json, list_jobs):
    """Show job states, the window and progress of a manifest, and both sides' busy and idle time
    (extract on a full window, train waiting for data) with the bottleneck."""
    import json

    from dflash_staged.manifest import Manifest
    from dflash_staged.manifest.status import format_status

    with Manifest.open(manifest_dir, readonly=True) as m:
        if list_jobs:
            jobs = [
                {
                    "id": j.id,
                    "epoch": j.epoch,
                    "pos": j.pos,
                    "bucket": j.bucket,
                    "sample_ids": j.sample_ids,
                    "state": j.state,
                    "real_tokens": j.real_tokens,
                    "padded_tokens": j.padded_tokens,
                }
                for j in m.jobs()
            ]
            if as_json:
                click.echo(json.dumps(jobs))
            else:
                click.echo(f"{'id':>8} {'epoch':>5} {'pos':>7} {'bucket':>6} {'samples':>7}  state")
                for j in jobs:
                    click.echo(
                        f"{j['id']:>8} {j['epoch']:>5} {j['pos']:>7} {j['bucket']:>6} "
                        f"{len(j['sample_ids']):>7}  {j['state']}"
                    )
        else:
            st = m.status()
            click.echo(json.dumps(st) if as_json else format_status(st))
