"""Byte sizes as the command line takes them: ``200G``, ``1.5T``, ``512M``, ``1000`` (bytes).

Units are binary (K = 2**10, M, G, T = 2**40); a trailing ``B`` or ``iB`` is allowed (``200GiB``).
A size is a whole number of bytes from 0 to :data:`MAX_BYTES` (fractions of a byte are dropped);
negative, infinite, NaN and malformed values are refused, and so is a non-zero value under one
byte. :class:`ByteSize` is the click type of every size flag: a bad value is click's usage error
naming the flag (``Error: Invalid value for '--window-bytes': ...``), never a traceback.
"""

from __future__ import annotations

import math

import click

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_BYTES = 2**63 - 1  # what the manifest's integer columns (SQLite INTEGER, PostgreSQL bigint) hold
EXAMPLES = "give a number of bytes or e.g. 512M, 200G, 1.5T"


def parse_size(text: str) -> int:
    """``'200G'`` -> bytes; ValueError saying what is wrong with ``text``."""
    t = str(text).strip().upper()
    t = t[:-1] if t.endswith("B") else t
    t = t[:-1] if t.endswith("I") and t[:-1][-1:] in UNITS else t
    unit = UNITS.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in UNITS else t
    try:
        x = float(number)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; {EXAMPLES}") from None
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"{text!r} is not a finite size; {EXAMPLES}")
    if x < 0:
        raise ValueError(f"{text!r} is negative; {EXAMPLES}")
    if x * unit > MAX_BYTES:
        raise ValueError(f"{text!r} is more than {MAX_BYTES:,} bytes; {EXAMPLES}")
    n = int(x * unit)
    if x > 0 and n == 0:
        raise ValueError(f"{text!r} is less than one byte; {EXAMPLES}")
    return n


class ByteSize(click.ParamType):
    """A size flag. ``zero``: what 0 means for this flag (e.g. ``"no limit"``); None refuses 0."""

    name = "size"

    def __init__(self, zero: str | None = None):
        self.zero = zero

    def convert(self, value, param, ctx) -> int:
        try:
            n = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if n == 0 and self.zero is None:
            self.fail(f"{value!r} is zero; {EXAMPLES}", param, ctx)
        return n
