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


if __name__ == "__main__":  # pragma: no cover
    main()
