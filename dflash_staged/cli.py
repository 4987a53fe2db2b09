"""The ``dflash`` command line: plan, status, extract, train, eval.

Each command is a thin wrapper; the work lives in the module named after it.
User errors (:class:`dflash_staged.errors.DflashError`) print one clean line and exit 1.
"""

from __future__ import annotations

import functools
import sys

import click

from .errors import DflashError


def user_errors(fn):
    """Turn DflashError into one `error: ...` line and exit code 1 (no traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-staged")
def main() -> None:
    """Train DFlash drafters with a disk-staged pipeline: plan -> extract | train -> eval."""


# --- commands are added below, one block per command -------------------------------------


@main.command("plan")
@click.option("--config", "config_path", required=True, help="Config TOML, e.g. configs/tiny.toml.")
@click.option("--data", "data_path", required=True, help="JSONL data: input_ids/loss_mask or messages per line.")
@click.option("--manifest", "manifest_dir", default=None, help="Manifest directory [default: manifests/<config stem>].")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True, help="Epochs to plan.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the job order.")
@click.option("--skip-bad", is_flag=True, help="Count and skip bad lines instead of stopping at the first.")
@user_errors
def plan_cmd(config_path, data_path, manifest_dir, epochs, seed, skip_bad):
    """Tokenise the data, bucket and batch it, and write the job manifest."""
    from .plan import plan_manifest
    click.echo(plan_manifest(config_path, data_path, manifest_dir, epochs=epochs, seed=seed, skip_bad=skip_bad,
                             progress=True))


@main.command("status")
@click.option("--manifest", "manifest_dir", required=True, help="Manifest directory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with --jobs: a JSON array of jobs).")
@click.option("--jobs", "list_jobs", is_flag=True, help="List every job: id, epoch, bucket, sample_ids, state.")
@user_errors
def status_cmd(manifest_dir, as_json, list_jobs):
    """Show job states, the window and progress of a manifest."""
    import json
    from .manifest import Manifest
    from .plan import format_status
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


if __name__ == "__main__":  # pragma: no cover
    main()
