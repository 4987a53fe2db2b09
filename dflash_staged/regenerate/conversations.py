"""The prompts of ``dflash regenerate``: conversations whose assistant turns the target re-answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_staged.errors import DflashError

ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    line: int  # 1-based line of the input file
    turns: list[dict]  # system and user turns, in order (assistant turns dropped)
    extra: dict  # the line's other keys, kept in the output

    @property
    def user_turns(self) -> int:
        return sum(t["role"] == "user" for t in self.turns)


def _bad(path, line: int, field: str, msg: str) -> DflashError:
    return DflashError(f"{path}:{line}: {field}: {msg}; each line must be "
                       '{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}')


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of the file, checked whole before anything is generated."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DflashError(f"{path}: cannot read the prompts file ({e.strerror}); check the path") from None
    except UnicodeDecodeError as e:
        raise DflashError(f"{path}: byte {e.start} is not UTF-8; save the file as UTF-8") from None
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, RecursionError, ValueError) as e:
            raise _bad(path, no, "(line)", f"malformed JSON ({str(e)[:80]})") from None
        if not isinstance(obj, dict) or "messages" not in obj:
            raise _bad(path, no, "messages", "missing field")
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise _bad(path, no, "messages", "expected a non-empty list")
        turns = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise _bad(path, no, f"messages[{i}]", "expected an object with a string content")
            if m.get("role") not in ROLES:
                raise _bad(path, no, f"messages[{i}].role", f"unknown role {m.get('role')!r}")
            if m["role"] != "assistant":
                turns.append({"role": m["role"], "content": m["content"]})
        conv = Conversation(no, turns, {k: v for k, v in obj.items() if k not in ("messages", "regenerated")})
        if not conv.user_turns:
            raise _bad(path, no, "messages", "no user turn to answer")
        out.append(conv)
    if not out:
        raise DflashError(f"{path}: no conversations (the file is empty)")
    return out
