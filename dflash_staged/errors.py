"""The user-facing error types. The CLI prints their message on one line, with no traceback.

Every message names what was wrong (file, line, field, path) and what to do about it.
"""

from __future__ import annotations

import functools
import sys


class DflashError(Exception):
    """An error the user can fix; the CLI prints ``error: <message>`` and exits 1."""


class DatasetError(DflashError, ValueError):
    """The data or one of its records is unusable; the message names the file, line or row, and field."""


class BadRecord(Exception):
    """Internal: one bad record (field, message); turned into DatasetError, or counted with --skip-bad."""

    def __init__(self, field: str, msg: str):
        super().__init__(msg)
        self.field = field


def user_errors(fn):
    """Turn DflashError into one `error: ...` line and exit code 1 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)

    return wrapper
