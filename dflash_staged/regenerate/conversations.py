"""The prompts of ``dflash regenerate``: conversations whose assistant turns the target re-answers.

They are read with the plan's own readers (:mod:`dflash_staged.plan.formats`,
:mod:`dflash_staged.plan.records`): JSONL, parquet or saved datasets, each record holding
``messages`` or ShareGPT-style ``conversations``, with the same role mapping and the same
errors naming file, line (or row) and field. Records are numbered from 1 across the input, in
order; that number is the ``regenerated.line`` of the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_staged.errors import BadRecord, DatasetError
from dflash_staged.plan.formats import sources
from dflash_staged.plan.records import decode_line, parse_conversations, parse_messages

KEEP = ("system", "developer", "user")  # turns kept as they are; assistant (and tool) turns are re-answered


@dataclass
class Conversation:
    line: int  # 1-based record number of the input
    turns: list[dict]  # the kept turns, in order
    extra: dict  # the record's other fields, kept in the output

    @property
    def user_turns(self) -> int:
        return sum(t["role"] == "user" for t in self.turns)


def _conversation(line: int, record) -> Conversation:
    obj = (
        decode_line(record)
        if isinstance(record, bytes)
        else {k: v for k, v in record.items() if v is not None}
    )
    if "messages" in obj:
        msgs, key = parse_messages(obj["messages"]), "messages"
    elif "conversations" in obj:
        msgs, key = parse_conversations(obj["conversations"], obj.get("system")), "conversations"
    else:
        raise BadRecord("messages", "missing field: a prompt needs messages or conversations (from/value)")
    conv = Conversation(
        line,
        [{"role": m["role"], "content": m["content"]} for m in msgs if m["role"] in KEEP],
        {k: v for k, v in obj.items() if k not in ("messages", "conversations", "system", "regenerated")},
    )
    if not conv.user_turns:
        raise BadRecord(key, "no user turn to answer")
    return conv


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of the input, checked whole before anything is generated."""
    out: list[Conversation] = []
    for src in sources(path):
        for no, record in src.records():
            try:
                out.append(_conversation(len(out) + 1, record))
            except BadRecord as e:
                raise DatasetError(
                    f"{src.where(no)}: field {e.field}: {e}; each record must hold messages "
                    "([{role, content}]) or conversations ([{from, value}])"
                ) from None
    if not out:
        raise DatasetError(f"{path}: no conversations (the input is empty)")
    return out
