"""What ``dflash plan --data PATH`` reads: the path's files, each a stream of records.

``PATH`` is one of

* a JSONL file: one JSON object per line; records are numbered by line (blank lines skipped);
* a parquet file (detected by its ``PAR1`` magic bytes, whatever its name): one record per row,
  read :data:`BATCH_ROWS` rows at a time with pyarrow's ``ParquetFile.iter_batches``, only the
  columns a record uses (:data:`COLUMNS`);
* a directory written by ``datasets.save_to_disk`` (it holds ``state.json``, or
  ``dataset_dict.json`` with one split): its Arrow files memory-mapped by
  ``datasets.load_from_disk`` and read :data:`BATCH_ROWS` rows at a time; for a DatasetDict with
  several splits, give the split's directory;
* any other directory: its ``*.jsonl``, ``*.json`` and ``*.parquet`` files in name order, each
  detected on its own (e.g. a hub dataset's ``data/train-0000X-of-0000N.parquet``).

Rows are numbered from 1 in each file. No file is ever held in memory whole. What a record holds
is :mod:`dflash_staged.plan.records`' business. Parquet and dataset directories need the optional
extra ``data`` (``pip install 'dflash-staged[data]'``: pyarrow, datasets).

:func:`data_hash` is the data's identity that a manifest records (``data_hash``; its "same plan?"
check compares it): the sha256 of a file's bytes; for a directory, of each file's path (relative
to it) and bytes in path order (dot-files aside); and, when ``[data] chat_template`` is set, of
the template's text too (it shapes the tokens as much as the data does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_staged.errors import DatasetError

BATCH_ROWS = 1024
COLUMNS = ("input_ids", "loss_mask", "messages", "conversations", "system")
_KEYS = ("input_ids", "messages", "conversations")  # one of these makes a row a record
_SUFFIXES = (".jsonl", ".json", ".parquet")
EXTRA_HINT = "pip install 'dflash-staged[data]' (pyarrow, datasets)"
LABELS = {"jsonl": "JSONL", "parquet": "parquet", "dataset": "datasets.save_to_disk directory"}


@dataclass
class Source:
    """One input: a JSONL file, a parquet file or a saved dataset."""

    path: Path
    kind: str  # "jsonl" | "parquet" | "dataset"

    def where(self, n: int) -> str:
        return f"{self.path}:{n}" if self.kind == "jsonl" else f"{self.path}: row {n}"

    def records(self) -> Iterator[tuple[int, bytes | dict]]:
        """(line or row number, record): raw line bytes (JSONL) or a row's dict."""
        if self.kind == "jsonl":
            return _jsonl_records(self.path)
        return _parquet_records(self.path) if self.kind == "parquet" else _dataset_records(self.path)

    def files(self) -> list[Path]:
        """The files whose bytes make this input (for :func:`data_hash`)."""
        return _tree(self.path) if self.kind == "dataset" else [self.path]


def _cannot_read(path: Path, e: OSError) -> DatasetError:
    return DatasetError(f"{path}: cannot read the data file ({e.strerror}); check the path")


def _tree(root: Path) -> list[Path]:
    return sorted(
        (
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ),
        key=lambda p: p.relative_to(root).as_posix(),
    )


def _is_parquet(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError as e:
        raise _cannot_read(path, e) from None


def sources(path: str | Path) -> list[Source]:
    """The inputs ``path`` names (see the module docstring); DatasetError if there are none."""
    path = Path(path)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return [Source(path, "dataset")]
        files = sorted(p for p in path.iterdir() if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise DatasetError(
                f"{path}: a directory with no *.jsonl, *.json or *.parquet files, and not one "
                "written by datasets.save_to_disk; give a data file or such a directory"
            )
        return [Source(p, "parquet" if _is_parquet(p) else "jsonl") for p in files]
    return [Source(path, "parquet" if _is_parquet(path) else "jsonl")]


def describe(srcs: list[Source]) -> str:
    """E.g. ``JSONL`` or ``3 files: parquet``."""
    kinds = sorted({LABELS[s.kind] for s in srcs})
    return ", ".join(kinds) if len(srcs) == 1 else f"{len(srcs)} files: {', '.join(kinds)}"


def data_hash(path: str | Path, chat_template: str | None = None) -> str:
    """The data's identity (see the module docstring), sha256 hex."""
    path = Path(path)
    h = hashlib.sha256()
    top_dir = path.is_dir()
    for f in (p for s in sources(path) for p in s.files()):
        if top_dir:
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            raise _cannot_read(f, e) from None
        if top_dir:
            h.update(b"\0")
    if chat_template is not None:
        h.update(b"\0chat_template\0" + chat_template.encode("utf-8"))
    return h.hexdigest()


# --- readers ---------------------------------------------------------------------------------


def _jsonl_records(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _cannot_read(path, e) from None
    with f:
        for n, raw in enumerate(f, 1):
            if raw.isspace():  # blank lines are not records
                continue
            yield n, raw.rstrip(b"\r\n")


def _needs_extra(path: Path, what: str) -> DatasetError:
    return DatasetError(f"{path} is {what}; reading it needs the optional extra 'data': {EXTRA_HINT}")


def _columns(path: Path, names: list[str]) -> list[str]:
    cols = [c for c in COLUMNS if c in names]
    if not any(c in _KEYS for c in cols):
        raise DatasetError(
            f"{path}: the columns are {', '.join(names) or '(none)'}; a row needs messages, "
            "conversations (from/value), or input_ids and loss_mask"
        )
    return cols


def _rows(batches) -> Iterator[tuple[int, dict]]:
    n = 1
    for batch in batches:  # pyarrow RecordBatches or Tables of the record columns
        for row in batch.to_pylist():
            yield n, row
            n += 1


def _parquet_records(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise _needs_extra(path, "a parquet file") from None
    try:
        pf = pq.ParquetFile(path)
        cols = _columns(path, pf.schema_arrow.names)
        yield from _rows(pf.iter_batches(batch_size=BATCH_ROWS, columns=cols))
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(
            f"{path}: cannot read the parquet file ({type(e).__name__}: {e}); check or rewrite the file"
        ) from None


def _dataset_records(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        import datasets
    except ImportError:
        raise _needs_extra(path, "a datasets.save_to_disk directory") from None
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = []
        if len(splits) != 1:
            raise DatasetError(
                f"{path}: a DatasetDict with the splits {', '.join(map(str, splits)) or '(none)'}; "
                f"give one split's directory, e.g. --data {path / str((splits or ['train'])[0])}"
            )
        path = path / str(splits[0])
    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DatasetError(
            f"{path}: cannot load the saved dataset ({type(e).__name__}: {e}); write it again "
            "with datasets.save_to_disk"
        ) from None
    cols = _columns(path, list(ds.column_names))
    yield from _rows(ds.select_columns(cols).with_format("arrow").iter(batch_size=BATCH_ROWS))
