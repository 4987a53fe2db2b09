"""One record (a JSONL line, a parquet or dataset row) -> token ids and a loss mask.

A record is an object holding one of

* ``input_ids`` and ``loss_mask``: already tokenised, one 0/1 (or boolean) per id;
* ``messages``: ``[{"role", "content"}, ...]`` with roles ``system``, ``developer``, ``user``,
  ``assistant``, ``tool``; an assistant turn may hold its reasoning apart, in a string
  ``reasoning_content``, as ``dflash regenerate`` stores it (rendered as :mod:`dflash_staged.chat` says);
* ``conversations`` (ShareGPT, UltraChat, perfectblend exports): ``[{"from", "value"}, ...]`` where
  ``from`` is ``human`` or ``user`` (-> user), ``gpt`` or ``assistant`` (-> assistant), or
  ``system``; a string ``system`` field beside it becomes a leading system message.

Conversations are rendered and masked by :mod:`dflash_staged.chat`. Other fields are
ignored. In a row (parquet, dataset) a null field counts as absent, so a table may hold
conversations in some rows and token ids in others; in a turn a null ``content``/``value`` is a
missing field. An unknown role, an empty conversation, a turn without text, ids outside the
vocabulary or the drafter's mask id are :class:`~dflash_staged.errors.BadRecord` naming
the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from dflash_staged.chat import ChatOptions, tokenize_messages
from dflash_staged.config import Config
from dflash_staged.errors import BadRecord
from dflash_staged.model.target.dims import target_dims

ROLES = ("system", "developer", "user", "assistant", "tool")
FROM_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
KINDS = {"input_ids": "token ids", "messages": "messages", "conversations": "conversations (from/value)"}


def _int_array(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, list):
        raise BadRecord(name, f"expected a list of integers, got {type(value).__name__}")
    if not value:
        raise BadRecord(name, "is empty; a sample needs at least one token")
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError):
        arr = np.asarray([0.5])  # ragged / nested: report as wrong type below
    if arr.ndim != 1 or arr.dtype.kind not in "iub" or (arr.dtype.kind == "b" and name == "input_ids"):
        bad = next(
            (
                v
                for v in value
                if not (isinstance(v, int) and not isinstance(v, bool) and -(2**62) < v < 2**62)
            ),
            value[0],
        )
        raise BadRecord(name, f"expected a list of integers, found {json.dumps(bad)[:40]}")
    return arr


def _turns(value: Any, key: str, role_key: str, text_key: str) -> list[dict]:
    """The turns of ``key``, each checked to hold string ``role_key`` and ``text_key`` fields."""
    if not isinstance(value, list) or not value:
        what = "is empty" if isinstance(value, list) else f"got {type(value).__name__}"
        raise BadRecord(key, f'{what}; expected a non-empty list of {{"{role_key}", "{text_key}"}} objects')
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise BadRecord(
                f"{key}[{i}]", f"expected an object with {role_key} and {text_key}, got {type(m).__name__}"
            )
        for k in (role_key, text_key):
            if m.get(k) is None:
                raise BadRecord(f"{key}[{i}].{k}", "missing field" + (" (null)" if k in m else ""))
            if not isinstance(m[k], str):
                raise BadRecord(f"{key}[{i}].{k}", f"expected a string, got {type(m[k]).__name__}")
    return value


def parse_messages(value: Any) -> list[dict]:
    out = _turns(value, "messages", "role", "content")
    for i, m in enumerate(out):
        r = m.get("reasoning_content")
        if r is not None and not isinstance(r, str):
            raise BadRecord(f"messages[{i}].reasoning_content", f"expected a string, got {type(r).__name__}")
        if m["role"] not in ROLES:
            raise BadRecord(
                f"messages[{i}].role",
                f"unknown role {m['role']!r}; use one of {', '.join(ROLES)} "
                "(ShareGPT-style turns go in conversations, with from/value)",
            )
    return out


def parse_conversations(value: Any, system: Any = None) -> list[dict]:
    """ShareGPT-style turns -> messages (roles mapped by :data:`FROM_ROLES`)."""
    turns = _turns(value, "conversations", "from", "value")
    out = []
    if system is not None:
        if not isinstance(system, str):
            raise BadRecord("system", f"expected a string, got {type(system).__name__}")
        if system:
            out.append({"role": "system", "content": system})
    for i, t in enumerate(turns):
        role = FROM_ROLES.get(t["from"])
        if role is None:
            raise BadRecord(
                f"conversations[{i}].from", f"unknown role {t['from']!r}; use one of {', '.join(FROM_ROLES)}"
            )
        out.append({"role": role, "content": t["value"]})
    return out


def decode_line(raw: bytes) -> dict:
    """A JSONL line's object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord("(line)", f"byte {e.start} is not valid UTF-8; save the file as UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord("(line)", f"malformed JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise BadRecord("(line)", "JSON nested too deeply to parse; a sample is one flat object") from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise BadRecord("(line)", f"malformed JSON: {str(e)[:120]}") from None
    if not isinstance(obj, dict):
        raise BadRecord("(line)", f"expected a JSON object, got {type(obj).__name__}")
    if (
        (b"true" in raw or b"false" in raw)
        and isinstance(obj.get("input_ids"), list)
        and any(type(v) is bool for v in obj["input_ids"])
    ):
        raise BadRecord("input_ids", "expected a list of integers, found true/false")  # numpy reads it as 1/0
    return obj


class RecordParser:
    """Turns one record (JSONL bytes, or a row's dict) into (ids int64, mask uint8, kind); raises BadRecord.

    ``tokenizer`` is a callable returning the tokenizer, called once, at the first conversation.
    """

    def __init__(self, cfg: Config, tokenizer: Callable[[], Any], chat: ChatOptions):
        self.vocab = target_dims(cfg.target).vocab_size
        self.mask_id = cfg.drafter.mask_token_id
        self.chat = chat
        self._tokenizer, self._tok = tokenizer, None
        self.off_prompt = 0  # conversations whose last assistant turn does not continue the generation prompt

    @property
    def tok(self):
        if self._tok is None:
            self._tok = self._tokenizer()
        return self._tok

    def __call__(self, record: bytes | dict) -> tuple[np.ndarray, np.ndarray, str]:
        if isinstance(record, dict):  # a row: null columns are absent
            obj = {k: v for k, v in record.items() if v is not None}
        else:
            obj = decode_line(record)
        present = [k for k in KINDS if k in obj]
        if len(present) > 1:
            raise BadRecord(
                present[1],
                f"a record holds one of input_ids/loss_mask, messages or conversations, "
                f"not {' and '.join(present)}",
            )
        if not present:
            raise BadRecord(
                "input_ids",
                "missing field: a record needs input_ids and loss_mask, messages, or conversations",
            )
        kind = present[0]
        if kind == "input_ids":
            ids, mask = self._token_ids(obj)
            where = "input_ids"
        else:
            messages = (
                parse_messages(obj["messages"])
                if kind == "messages"
                else parse_conversations(obj["conversations"], obj.get("system"))
            )
            info: dict = {}
            ids, mask = tokenize_messages(self.tok, messages, self.chat, info)
            if len(ids) == 0:
                raise BadRecord(kind, "renders to an empty token sequence")
            self.off_prompt += not info.get("continues_prompt", True)
            where = f"{kind} (tokenised)"
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab:
            bad = lo if lo < 0 else hi
            pos = int(np.flatnonzero(ids == bad)[0])
            raise BadRecord(where, f"id {bad} at position {pos} is outside the vocabulary [0, {self.vocab})")
        if self.mask_id >= 0 and (ids == self.mask_id).any():
            pos = int(np.flatnonzero(ids == self.mask_id)[0])
            raise BadRecord(
                where,
                f"contains the drafter's mask token id {self.mask_id} (drafter.mask_token_id) "
                f"at position {pos}; the mask id must never occur in data",
            )
        return ids, mask, kind

    @staticmethod
    def _token_ids(obj: dict) -> tuple[np.ndarray, np.ndarray]:
        ids = _int_array(obj["input_ids"], "input_ids")
        if "loss_mask" not in obj:
            raise BadRecord("loss_mask", "missing field; give one 0/1 per input id")
        mask = _int_array(obj["loss_mask"], "loss_mask")
        if len(mask) != len(ids):
            raise BadRecord(
                "loss_mask", f"has {len(mask)} values but input_ids has {len(ids)}; give one 0/1 per input id"
            )
        if mask.dtype.kind != "b" and not ((mask == 0) | (mask == 1)).all():
            bad = int(mask[(mask != 0) & (mask != 1)][0])
            raise BadRecord("loss_mask", f"value {bad} is not 0 or 1")
        return ids, mask.astype(np.uint8)
