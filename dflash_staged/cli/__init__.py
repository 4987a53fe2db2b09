"""The ``dflash`` command line, listed in pipeline order: regenerate, data show, plan, memory, extract,
train, the launchers pipeline (one host) and node (one GPU node), status, plot, eval and serve.

Each command is a thin wrapper; the work lives in the module named after it. The commands are grouped by
stage: :mod:`~dflash_staged.cli.data` (plan, data show, status), :mod:`~dflash_staged.cli.stages`
(extract, train; train's torchrun relaunch in :mod:`~dflash_staged.cli.torchrun`),
:mod:`~dflash_staged.cli.regenerate` (regenerate),
:mod:`~dflash_staged.cli.results` (eval, plot), :mod:`~dflash_staged.cli.serve` (serve build, export, eval),
:mod:`~dflash_staged.cli.memory` (memory) and :mod:`dflash_staged.launch.commands` (pipeline, node);
:mod:`~dflash_staged.cli.options` holds what they share (the group listing its commands in order,
``--manifest`` help, ``--set`` and JSON values). None of them imports torch at module level, so ``--help``
is fast. User errors (:class:`dflash_staged.errors.DflashError`) print one clean line and exit 1.
"""

from __future__ import annotations

import click

from dflash_staged.cli.data import data_group, plan_cmd, status_cmd
from dflash_staged.cli.memory import memory_cmd
from dflash_staged.cli.options import MANIFEST_HELP, InOrder, parse_json_object, parse_sets
from dflash_staged.cli.regenerate import regenerate
from dflash_staged.cli.results import eval_cmd, plot_cmd
from dflash_staged.cli.serve import serve_group
from dflash_staged.cli.stages import extract, train
from dflash_staged.cli.torchrun import TORCHRUN_PID, die_with_torchrun, without_option
from dflash_staged.launch.commands import node, pipeline

__all__ = [
    "main",
    "MANIFEST_HELP",
    "parse_sets",
    "parse_json_object",
    "TORCHRUN_PID",
    "die_with_torchrun",
    "without_option",
]


@click.group(cls=InOrder, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-staged")
def main() -> None:
    """Train DFlash drafters with a disk-staged pipeline.

    \b
    The commands are listed in the order a run uses them:
      regenerate -> data show -> plan -> extract | train -> eval -> serve

    pipeline (one host) and node (one GPU node) run plan, extract and train side by side; memory checks
    that a recipe fits a GPU before any is used; status and plot show a run as it goes.
    """


for _command in (  # pipeline order: `dflash --help` lists them so
    regenerate,
    data_group,
    plan_cmd,
    memory_cmd,
    extract,
    train,
    pipeline,
    node,
    status_cmd,
    plot_cmd,
    eval_cmd,
    serve_group,
):
    main.add_command(_command)
