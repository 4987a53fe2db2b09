"""What the commands share: the ``--manifest`` help, and the parsing of ``--set`` and JSON option values."""

from __future__ import annotations

from dflash_staged.errors import DflashError

MANIFEST_HELP = (
    "Manifest: a directory (SQLite, one host) or postgresql://USER@HOST:PORT/DB#NAME (many hosts)."
)


def parse_sets(sets) -> dict:
    """['train.lr=1e-3', 'drafter.block_size=8'] -> {'train': {'lr': 0.001}, 'drafter': {'block_size': 8}}."""
    from dflash_staged.config import tomllib

    out: dict = {}
    for s in sets:
        key, sep, value = s.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise DflashError(f"--set {s!r}: use SECTION.KEY=VALUE, e.g. --set train.lr=1e-3")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        out.setdefault(section, {})[name] = parsed
    return out


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
