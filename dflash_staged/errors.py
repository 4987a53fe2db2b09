"""The user-facing error types. The CLI prints their message on one line, with no traceback.

Every message names what was wrong (file, line, field, path) and what to do about it.
"""

from __future__ import annotations

import errno
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


# The errors a user fixes by choosing another path (or freeing space): one line, no traceback.
USER_ERRNOS = {
    errno.EROFS: "choose a path on a writable disk",
    errno.EACCES: "choose a path you can write, or fix its permissions",
    errno.EPERM: "choose a path you can write",
    errno.ENOSPC: "free some space or choose another disk",
    errno.EDQUOT: "free some space or choose another disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "give a file, not a folder",
    errno.ENAMETOOLONG: "choose a shorter path",
}


def os_error_line(e: OSError, flag: str = "") -> str | None:
    """One line for an OS error a user fixes (read-only, permission, no space, not a directory), naming
    ``flag`` and the path; None for any other error (a bug to show in full)."""
    fix = USER_ERRNOS.get(e.errno)
    if fix is None:
        return None
    where = " ".join(str(x) for x in (flag, e.filename) if x)
    return f"{where or 'a path'}: {e.strerror}; {fix}"


def user_errors(fn):
    """The CLI's error boundary: a DflashError, or an OS error the user fixes by choosing another path
    (read-only, permission, no space, not a directory: :func:`os_error_line`),
    becomes one `error: ...` line and exit code 1 (no traceback); anything else is a bug, shown in full."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        except OSError as e:
            line = os_error_line(e)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            sys.exit(1)

    return wrapper
