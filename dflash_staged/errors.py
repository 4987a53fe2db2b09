"""The user-facing error type. The CLI prints its message on one line, with no traceback.

Every message names what was wrong (file, line, field, path) and what to do about it.
"""


class DflashError(Exception):
    """An error the user can fix; the CLI prints ``error: <message>`` and exits 1."""
