"""Dataset ingestion: JSONL lines -> token ids + loss masks, all in memory.

Each line of the input file is one JSON object, either

* ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (already tokenised), or
* ``{"messages": [{"role": str, "content": str}, ...]}``, rendered with the
  target's chat template and tokenised with its tokenizer. The loss covers the
  assistant turns only: each assistant message's text as the model generates it,
  from the end of the generation prompt through the end-of-turn marker (e.g.
  ``content<|im_end|>``), trailing whitespace excluded. The tokenizer is loaded
  only if a messages line appears.

Assistant spans are found without ``{% generation %}`` markers (real templates
such as Qwen3's lack them). For assistant message i, the text that rendering
``messages[:i+1]`` adds to rendering ``messages[:i]`` with the generation prompt
is the turn; when the full rendering starts with that prefix (append-only
templates) the span is taken from there. Otherwise (the first message, or a
template that rewrites history, as Qwen3 strips the ``<think>`` block of earlier
turns) the conversation is re-rendered with message i's content replaced by two
different sentinels: the region where the renderings differ from the full one
is the rendered content, extended over the end-of-turn marker that follows it.
Characters map to tokens through the fast tokenizer's offsets: a token is a
loss token when its character range overlaps an assistant span.

Per sample, in this order: bad lines raise :class:`DatasetError` naming
``file:line`` and the field (with ``skip_bad`` they are counted as ``bad`` and
skipped); sequences longer than ``data.max_len`` are truncated (``truncated``)
or skipped (``skipped_long``) per ``data.overlength``; samples with fewer than
``cfg.min_loss_tokens`` loss tokens after truncation are skipped
(``skipped_short_loss``). An empty file or one with no usable sample is an
error even with ``skip_bad``. Ingestion writes nothing; the caller persists the
returned :class:`Samples` (see :mod:`dflash_staged.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dflash_staged.config import Config, TargetConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.dims import target_dims

FIX_HINT = "fix or remove the line, or pass --skip-bad to skip bad lines"


class DatasetError(DflashError, ValueError):
    """A data file or one of its lines is unusable; the message names file:line and field."""


class _BadLine(Exception):
    """Internal: one bad line (field, message); turned into DatasetError or counted."""

    def __init__(self, field: str, msg: str):
        super().__init__(msg)
        self.field = field


@dataclass
class Samples:
    """Tokenised samples, concatenated: sample i is ``tokens[offsets[i]:offsets[i+1]]``."""

    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 = loss on this position
    offsets: np.ndarray  # int64 [N+1]
    lines: np.ndarray  # int64 [N], 1-based source line of each sample
    stats: dict = field(default_factory=dict)  # lines, samples, bad, truncated, skipped_long, skipped_short_loss
    bad_examples: list[str] = field(default_factory=list)  # first few bad-line messages (with skip_bad)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]


# --- the tokenizer -------------------------------------------------------------------------

def _load_tokenizer(tcfg: TargetConfig):
    from dflash_staged.model.target import load_tokenizer  # the target module owns tokenizer loading
    return load_tokenizer(tcfg)


# --- chat rendering and assistant spans ------------------------------------------------------

def _render(tok, messages: list[dict], gen: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


_SENTINELS = ("\ue000\ue001", "\ue002\ue003")  # differ at both ends; private-use, never in text


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a[:n].encode("utf-32-le"), dtype=np.uint32)
    y = np.frombuffer(b[:n].encode("utf-32-le"), dtype=np.uint32)
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if len(neq) else n


def _diff_span(tok, messages: list[dict], i: int, full: str) -> tuple[int, int]:
    """Locate turn i in `full` by re-rendering with its content replaced by sentinels."""
    start, end = len(full), 0
    for s in _SENTINELS:
        alt = messages[:i] + [{**messages[i], "content": s}] + messages[i + 1:]
        r = _render(tok, alt, False)
        p = _common_prefix(full, r)
        q = _common_prefix(full[p:][::-1], r[p:][::-1])
        start, end = min(start, p), max(end, len(full) - q)
    # extend over the end-of-turn marker that follows the content (e.g. <|im_end|>)
    b = _render(tok, messages[:i] + [{**messages[i], "content": _SENTINELS[0]}], False)
    at = b.rfind(_SENTINELS[0])
    tail = b[at + len(_SENTINELS[0]):].rstrip() if at >= 0 else ""
    if tail and full.startswith(tail, end):
        end += len(tail)
    return start, max(start, end)


def assistant_spans(tok, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (the rendering of `messages`)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = None
        if i:  # append-only templates: the turn is what messages[:i+1] adds to the generation prompt
            try:
                a = _render(tok, messages[:i], True)
                b = _render(tok, messages[: i + 1], False)
            except Exception:  # noqa: BLE001 - some templates refuse odd prefixes; fall back below
                a = b = ""
            if a and b.startswith(a):
                end = len(a) + len(b[len(a):].rstrip())
                if full.startswith(b[:end]):
                    span = (len(a), end)
        if span is None:  # history rewritten (e.g. Qwen3 strips old <think>) or first message
            try:
                span = _diff_span(tok, messages, i, full)
            except Exception as e:  # noqa: BLE001
                raise _BadLine(f"messages[{i}]", f"the chat template failed on a re-rendering used to find the "
                                                 f"loss tokens ({type(e).__name__}: {e})") from None
        if span[0] < cursor:
            raise _BadLine(f"messages[{i}].content",
                           "cannot locate this assistant message in the rendered chat template; "
                           "pre-tokenise the line to input_ids/loss_mask")
        spans.append(span)
        cursor = span[1]
    return spans


def tokenize_messages(tok, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Render `messages` with the chat template; return (ids, loss mask on assistant turns)."""
    if not getattr(tok, "is_fast", False):
        raise DatasetError(f"the tokenizer {type(tok).__name__} is not a fast tokenizer, so messages lines "
                           "cannot be mapped to loss tokens; pre-tokenise the data to input_ids/loss_mask")
    try:
        full = _render(tok, messages, False)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are data errors
        raise _BadLine("messages", f"the chat template rejected the conversation ({type(e).__name__}: {e})") from None
    spans = assistant_spans(tok, messages, full)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offs = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for s, e in spans:
        mask |= ((offs[:, 0] < e) & (offs[:, 1] > s)).astype(np.uint8)
    return ids, mask


# --- line parsing --------------------------------------------------------------------------

def _int_array(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, list):
        raise _BadLine(name, f"expected a list of integers, got {type(value).__name__}")
    if not value:
        raise _BadLine(name, "is empty; a sample needs at least one token")
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError):
        arr = np.asarray([0.5])  # ragged / nested: report as wrong type below
    if arr.ndim != 1 or arr.dtype.kind not in "iub" or (arr.dtype.kind == "b" and name == "input_ids"):
        bad = next((v for v in value if not (isinstance(v, int) and not isinstance(v, bool)
                                             and -2**62 < v < 2**62)), value[0])
        raise _BadLine(name, f"expected a list of integers, found {json.dumps(bad)[:40]}")
    return arr


def _parse_messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _BadLine("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _BadLine(f"messages[{i}]", f"expected an object with role and content, got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise _BadLine(f"messages[{i}].{key}", "missing field")
            if not isinstance(m[key], str):
                raise _BadLine(f"messages[{i}].{key}", f"expected a string, got {type(m[key]).__name__}")
        out.append(m)
    return out


class _Parser:
    """Turns one raw line into (ids int64, mask uint8); raises _BadLine."""

    def __init__(self, cfg: Config, tokenizer=None):
        self.cfg = cfg
        self.vocab = target_dims(cfg.target).vocab_size
        self.mask_id = cfg.drafter.mask_token_id
        self._tok = tokenizer

    @property
    def tok(self):
        if self._tok is None:
            self._tok = _load_tokenizer(self.cfg.target)
        return self._tok

    def __call__(self, raw: bytes) -> tuple[np.ndarray, np.ndarray]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _BadLine("(line)", f"byte {e.start} is not valid UTF-8; save the file as UTF-8") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise _BadLine("(line)", f"malformed JSON: {e.msg} at column {e.colno}") from None
        except RecursionError:
            raise _BadLine("(line)", "JSON nested too deeply to parse; a sample is one flat object") from None
        except ValueError as e:  # e.g. an integer literal too long to convert
            raise _BadLine("(line)", f"malformed JSON: {str(e)[:120]}") from None
        if not isinstance(obj, dict):
            raise _BadLine("(line)", f"expected a JSON object, got {type(obj).__name__}")
        if "input_ids" in obj:
            if "messages" in obj:
                raise _BadLine("messages", "a line has either input_ids/loss_mask or messages, not both")
            ids = _int_array(obj["input_ids"], "input_ids")
            if (b"true" in raw or b"false" in raw) and any(type(v) is bool for v in obj["input_ids"]):
                raise _BadLine("input_ids", "expected a list of integers, found true/false")  # numpy reads it as 1/0
            if "loss_mask" not in obj:
                raise _BadLine("loss_mask", "missing field; give one 0/1 per input id")
            mask = _int_array(obj["loss_mask"], "loss_mask")
            if len(mask) != len(ids):
                raise _BadLine("loss_mask", f"has {len(mask)} values but input_ids has {len(ids)}; "
                                            "give one 0/1 per input id")
            if mask.dtype.kind != "b" and not ((mask == 0) | (mask == 1)).all():
                bad = int(mask[(mask != 0) & (mask != 1)][0])
                raise _BadLine("loss_mask", f"value {bad} is not 0 or 1")
            mask = mask.astype(np.uint8)
            where = "input_ids"
        elif "messages" in obj:
            ids, mask = tokenize_messages(self.tok, _parse_messages(obj["messages"]))
            if len(ids) == 0:
                raise _BadLine("messages", "renders to an empty token sequence")
            where = "messages (tokenised)"
        else:
            raise _BadLine("input_ids", "missing field: a line needs input_ids and loss_mask, or messages")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab:
            bad = lo if lo < 0 else hi
            pos = int(np.flatnonzero(ids == bad)[0])
            raise _BadLine(where, f"id {bad} at position {pos} is outside the vocabulary [0, {self.vocab})")
        if self.mask_id >= 0 and (ids == self.mask_id).any():
            pos = int(np.flatnonzero(ids == self.mask_id)[0])
            raise _BadLine(where, f"contains the drafter's mask token id {self.mask_id} (drafter.mask_token_id) "
                                  f"at position {pos}; the mask id must never occur in data")
        return ids, mask


def data_hash(path: str | Path) -> str:
    """sha256 (hex) of the data file's bytes: the ``data_hash`` a manifest records for its plan."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the data file ({e.strerror}); check the path") from None
    return h.hexdigest()


def load_dataset(path: str | Path, cfg: Config, *, skip_bad: bool = False,
                 tokenizer=None, progress: bool = False) -> tuple[Samples, str]:
    """Read and tokenise a JSONL file. Returns (samples, sha256 hex of the file bytes).

    Raises DatasetError (naming file:line and field) on the first bad line unless
    `skip_bad`; always raises when the file is empty or no sample is usable.
    `progress` shows a tqdm bar on stderr when it is a terminal.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the data file ({e.strerror}); check the path") from None
    digest = data_hash(path)
    if not data or data.isspace():
        raise DatasetError(f"{path}: the data file is empty; give one JSON object per line")
    parse = _Parser(cfg, tokenizer)
    max_len, skip_long = cfg.data.max_len, cfg.data.overlength == "skip"
    min_loss = cfg.min_loss_tokens
    stats = dict(lines=0, samples=0, bad=0, truncated=0, skipped_long=0, skipped_short_loss=0)
    bad_examples: list[str] = []
    ids_parts, mask_parts, lens, lines = [], [], [], []
    raw_lines = data.split(b"\n")
    bar = tqdm(raw_lines, unit="line", desc="tokenise", disable=None if progress else True,
               mininterval=1.0, file=sys.stderr)
    for lineno, raw in enumerate(bar, 1):
        if not raw or raw.isspace():  # blank lines are not samples (isspace: no copy, unlike strip)
            continue
        stats["lines"] += 1
        try:
            ids, mask = parse(raw)
        except _BadLine as e:
            msg = f"{path}:{lineno}: field {e.field}: {e}"
            if not skip_bad:
                raise DatasetError(f"{msg}; {FIX_HINT}") from None
            stats["bad"] += 1
            if len(bad_examples) < 5:
                bad_examples.append(msg)
            continue
        if len(ids) > max_len:
            if skip_long:
                stats["skipped_long"] += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            stats["truncated"] += 1
        if int(mask.sum()) < min_loss:
            stats["skipped_short_loss"] += 1
            continue
        ids_parts.append(ids.astype(np.int32))
        mask_parts.append(mask)
        lens.append(len(ids))
        lines.append(lineno)
    stats["samples"] = len(lens)
    if not lens:
        raise DatasetError(
            f"{path}: no usable samples in {stats['lines']} lines ({stats['bad']} bad, "
            f"{stats['skipped_long']} longer than data.max_len={max_len}, {stats['skipped_short_loss']} with "
            f"fewer than {min_loss} loss tokens); check the data, data.max_len, data.overlength and "
            "data.min_loss_tokens")
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    samples = Samples(tokens=np.concatenate(ids_parts), loss_mask=np.concatenate(mask_parts),
                      offsets=offsets, lines=np.asarray(lines, dtype=np.int64), stats=stats,
                      bad_examples=bad_examples)
    return samples, digest
