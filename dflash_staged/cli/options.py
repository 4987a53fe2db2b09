"""What the commands share: the ``--manifest`` help, and the parsing of ``--set`` and JSON option values."""

from __future__ import annotations

from dflash_staged.config.overrides import parse_sets  # noqa: F401 (re-export)
from dflash_staged.errors import DflashError

MANIFEST_HELP = (
    "Manifest: a directory (SQLite, one host) or postgresql://USER@HOST:PORT/DB#NAME (many hosts)."
)


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
