"""The ``dflash`` command line: plan, data show, status, extract, train, eval, serve, regenerate, plot,
memory, and the launchers pipeline (one host) and node (one GPU node).

Each command is a thin wrapper; the work lives in the module named after it. The commands are grouped by
stage: :mod:`~dflash_staged.cli.data` (plan, data show, status), :mod:`~dflash_staged.cli.stages`
(extract, train, regenerate; train's torchrun relaunch in :mod:`~dflash_staged.cli.torchrun`),
:mod:`~dflash_staged.cli.results` (eval, plot), :mod:`~dflash_staged.cli.serve` (serve build, export, eval),
:mod:`~dflash_staged.cli.memory` (memory) and :mod:`dflash_staged.launch.commands` (pipeline, node);
:mod:`~dflash_staged.cli.options` holds what they share (``--manifest`` help, ``--set`` and JSON values).
User errors (:class:`dflash_staged.errors.DflashError`) print one clean line and exit 1.
"""

from __future__ import annotations

import click

from dflash_staged.cli.data import data_group, plan_cmd, status_cmd
from dflash_staged.cli.memory import memory_cmd
from dflash_staged.cli.options import MANIFEST_HELP, parse_json_object, parse_sets
from dflash_staged.cli.results import eval_cmd, plot_cmd
from dflash_staged.cli.serve import serve_group
from dflash_staged.cli.stages import extract, regenerate, train
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash-staged")
def main() -> None:
    """Train DFlash drafters with a disk-staged pipeline: plan -> extract | train -> eval."""


for _command in (
    plan_cmd,
    data_group,
    status_cmd,
    extract,
    train,
    regenerate,
    eval_cmd,
    serve_group,
    plot_cmd,
    memory_cmd,
    pipeline,
    node,
):
    main.add_command(_command)
