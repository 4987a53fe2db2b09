"""What the commands share: the group that lists its commands in pipeline order, the ``--manifest``
help, and the parsing of ``--set`` and JSON option values.

The command modules import nothing heavy at module level (no torch, transformers or numpy, nor the
packages that import them): ``dflash --help`` and every ``--help`` stay fast. The work is imported
inside each command's function.
"""

from __future__ import annotations

import click

from dflash_staged.errors import DflashError

MANIFEST_HELP = (
    "Manifest: a directory (SQLite, one host) or postgresql://USER@HOST:PORT/DB#NAME (many hosts)."
)


class InOrder(click.Group):
    """A group whose ``--help`` lists its commands in the order they were added (the pipeline's), not
    sorted by name."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def parse_sets(sets) -> dict:
    """``--set SECTION.KEY=VALUE`` options -> ``{section: {key: value}}``
    (:func:`dflash_staged.config.overrides.parse_sets`, imported only when a command runs)."""
    from dflash_staged.config.overrides import parse_sets as parse

    return parse(sets)


def parse_json_object(text: str | None, flag: str) -> dict | None:
    """``'{"enable_thinking": true}'`` -> a dict (None stays None)."""
    import json

    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DflashError(
            f"{flag} {text!r}: not JSON ({e.msg}); give an object, e.g. '{{\"enable_thinking\": false}}'"
        ) from None
    if not isinstance(obj, dict):
        raise DflashError(f"{flag} {text!r}: give a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return obj
