"""The config's error and its one check helper (shared by every section of :mod:`.schema`)."""

from __future__ import annotations

from dflash_staged.errors import DflashError


class ConfigError(DflashError, ValueError):
    """A config file or value is invalid. The message names file, key and the fix."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)
