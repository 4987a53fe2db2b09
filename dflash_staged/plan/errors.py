"""The errors of data ingestion: one for the user, one internal to a record."""

from __future__ import annotations

from dflash_staged.errors import DflashError


class DatasetError(DflashError, ValueError):
    """The data or one of its records is unusable; the message names the file, line or row, and field."""


class BadRecord(Exception):
    """Internal: one bad record (field, message); turned into DatasetError, or counted with --skip-bad."""

    def __init__(self, field: str, msg: str):
        super().__init__(msg)
        self.field = field
