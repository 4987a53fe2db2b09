"""Dataset ingestion: records -> token ids + loss masks, concatenated in memory.

The input formats (JSONL, parquet, saved datasets; detected per file) are read as streams of
records by :mod:`dflash_staged.plan.formats`; what a record may hold (token ids, ``messages``,
ShareGPT-style ``conversations``) and how it becomes ids and a mask is
:mod:`dflash_staged.plan.records`; how conversations are rendered (chat template, its options)
and which tokens carry the loss is :mod:`dflash_staged.chat`. The tokenizer is loaded only
if a conversation appears.

Per sample, in this order: bad records raise :class:`DatasetError` naming ``file:line`` (JSONL)
or ``file: row N`` and the field (with ``skip_bad`` they are counted as ``bad`` and skipped);
sequences longer than ``data.max_len`` are truncated (``truncated``) or skipped
(``skipped_long``) per ``data.overlength``; samples with fewer than ``cfg.min_loss_tokens``
loss tokens after truncation are skipped (``skipped_short_loss``). An empty input or one with no
usable sample is an error even with ``skip_bad``. Only the samples' own arrays grow with the
data (int32 ids, uint8 mask, int64 offsets, in chunks); the input is streamed. Ingestion writes
nothing; the caller persists the returned :class:`Samples` (see :mod:`dflash_staged.manifest`).
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dflash_staged.chat import ChatOptions, assistant_spans, tokenize_messages  # noqa: F401 - re-exported
from dflash_staged.config import Config, TargetConfig
from dflash_staged.errors import BadRecord, DatasetError
from dflash_staged.plan import formats
from dflash_staged.plan.formats import data_hash  # noqa: F401 - re-exported: the manifest's data identity
from dflash_staged.plan.records import KINDS, RecordParser

FIX_HINT = "fix or remove the record, or pass --skip-bad to skip bad records"


@dataclass
class Samples:
    """Tokenised samples, concatenated: sample i is ``tokens[offsets[i]:offsets[i+1]]``."""

    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 = loss on this position
    offsets: np.ndarray  # int64 [N+1]
    lines: (
        np.ndarray
    )  # int64 [N], 1-based source line (JSONL) or row of each sample, numbered on across files
    # lines (records read), samples, bad, truncated, skipped_long, skipped_short_loss; format (what was read);
    # off_prompt (if any): conversations whose last assistant turn does not continue the generation prompt
    stats: dict = field(default_factory=dict)
    bad_examples: list[str] = field(default_factory=list)  # first few bad-record messages (with skip_bad)
    short_examples: list[str] = field(default_factory=list)  # first few records skipped for few loss tokens

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]


def _load_tokenizer(tcfg: TargetConfig):
    from dflash_staged.model.target import load_tokenizer  # the target module owns tokenizer loading

    return load_tokenizer(tcfg)


class _Chunks:
    """A growing 1-D array kept as a list of concatenated chunks (no per-sample objects kept)."""

    def __init__(self, dtype, every: int = 4096):
        self.dtype, self.every, self.done, self.cur = dtype, every, [], []

    def add(self, a: np.ndarray) -> None:
        self.cur.append(a.astype(self.dtype, copy=False))
        if len(self.cur) >= self.every:
            self.done.append(np.concatenate(self.cur))
            self.cur = []

    def array(self) -> np.ndarray:
        """The whole array. Chunks are copied last first and freed once copied, so the heap shrinks
        from its top as the result fills (peak: about the result plus one chunk)."""
        if self.cur:
            self.done.append(np.concatenate(self.cur))
            self.cur = []
        end = sum(len(p) for p in self.done)
        out = np.empty(end, self.dtype)
        while self.done:
            part = self.done.pop()
            out[end - len(part) : end] = part
            end -= len(part)
        return out


def _format_name(srcs: list[formats.Source], kinds: Counter) -> str:
    recs = " + ".join(f"{n:,} {KINDS[k]}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return formats.describe(srcs) + (f", {recs}" if recs else "")


def load_dataset(
    path: str | Path,
    cfg: Config,
    *,
    skip_bad: bool = False,
    tokenizer=None,
    progress: bool = False,
    chat: ChatOptions | None = None,
) -> tuple[Samples, str]:
    """Read and tokenise the data at `path`. Returns (samples, :func:`data_hash` of the input).

    Raises DatasetError (naming file, line or row, and field) on the first bad record unless
    `skip_bad`; always raises when the input is empty or no sample is usable. `chat` defaults
    to the options of ``cfg.data``. `progress` shows a tqdm bar on stderr when it is a terminal.
    """
    path = Path(path)
    chat = chat if chat is not None else ChatOptions.from_config(cfg.data)
    srcs = formats.sources(path)
    digest = data_hash(path, chat.template)
    parse = RecordParser(
        cfg, lambda: tokenizer if tokenizer is not None else _load_tokenizer(cfg.target), chat
    )
    max_len, skip_long = cfg.data.max_len, cfg.data.overlength == "skip"
    min_loss = cfg.min_loss_tokens
    stats = dict(lines=0, samples=0, bad=0, truncated=0, skipped_long=0, skipped_short_loss=0)
    bad_examples: list[str] = []
    short_examples: list[str] = []
    kinds: Counter = Counter()
    ids_acc, mask_acc = _Chunks(np.int32), _Chunks(np.uint8)
    lens, lines = array("q"), array("q")
    bar = tqdm(
        unit="record", desc="tokenise", disable=None if progress else True, mininterval=1.0, file=sys.stderr
    )
    base = 0  # records are numbered on across the files of a directory
    for src in srcs:
        last = 0
        for n, record in src.records():
            last = n
            bar.update()
            stats["lines"] += 1
            try:
                ids, mask, kind = parse(record)
            except BadRecord as e:
                msg = f"{src.where(n)}: field {e.field}: {e}"
                if not skip_bad:
                    raise DatasetError(f"{msg}; {FIX_HINT}") from None
                stats["bad"] += 1
                if len(bad_examples) < 5:
                    bad_examples.append(msg)
                continue
            kinds[kind] += 1
            if len(ids) > max_len:
                if skip_long:
                    stats["skipped_long"] += 1
                    continue
                ids, mask = ids[:max_len], mask[:max_len]
                stats["truncated"] += 1
            if int(mask.sum()) < min_loss:
                stats["skipped_short_loss"] += 1
                if len(short_examples) < 5:
                    k = int(mask.sum())
                    why = " (no assistant turn to learn from)" if k == 0 and kind != "input_ids" else ""
                    short_examples.append(f"{src.where(n)}: {k} loss token(s){why}")
                continue
            ids_acc.add(ids)
            mask_acc.add(mask)
            lens.append(len(ids))
            lines.append(base + n)
        base += last
    stats["last_record"] = base  # the number of the last line or row read (data show: past the end)
    bar.close()
    stats["samples"] = len(lens)
    stats["format"] = _format_name(srcs, kinds)
    if parse.off_prompt:
        stats["off_prompt"] = parse.off_prompt
    if not stats["lines"]:
        raise DatasetError(
            f"{path}: the data file is empty (no lines or rows); give one JSON object per line, "
            "or a parquet file or saved dataset with rows"
        )
    if not lens:
        raise DatasetError(
            f"{path}: no usable samples in {stats['lines']} records ({stats['bad']} bad, "
            f"{stats['skipped_long']} longer than data.max_len={max_len}, {stats['skipped_short_loss']} with "
            f"fewer than {min_loss} loss tokens); check the data, data.max_len, data.overlength and "
            "data.min_loss_tokens"
        )
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lens, dtype=np.int64), out=offsets[1:])
    samples = Samples(
        tokens=ids_acc.array(),
        loss_mask=mask_acc.array(),
        offsets=offsets,
        lines=np.frombuffer(lines, dtype=np.int64).copy(),
        stats=stats,
        bad_examples=bad_examples,
        short_examples=short_examples,
    )
    return samples, digest
