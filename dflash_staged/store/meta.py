"""The store's vocabulary: format constants, metadata records, shard tensors and errors.

The layout they describe is specified in :mod:`dflash_staged.store.shard_store`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_staged.dtypes import DTYPES
from dflash_staged.errors import DflashError
from dflash_staged.store.fp8 import FP8, SCALE_BYTES, STORE_DTYPES

FORMAT_VERSION = 1
ARRAYS = ("hidden", "input_ids", "loss_mask", "cu_seqlens", "sample_ids")
COMPRESSIONS = ("none", "zstd")
# logical dtype -> (torch dtype, zarr data_type on disk)
LOGICAL_DTYPES = {
    name: (DTYPES[name], zdt)
    for name, zdt in (("bfloat16", "uint16"), ("float16", "float16"), ("float32", "float32"))
}
TOKEN_BYTES = 5  # per token besides the hidden states: int32 input id + uint8 loss mask


TOPK_TOKEN_BYTES = 4 + 2  # a stored top-k entry: int32 id + float16 log-probability
TOPK_TAIL_BYTES = 4  # a token's float32 log of the mass outside its stored top-k


def bytes_per_token(
    num_layers: int,
    hidden_size: int,
    itemsize: int,
    topk: int = 0,
    store_dtype: str = "target",
    topk_tail: bool = True,
) -> int:
    """Shard bytes per real token: K stored states (the taps, and the last layer when stored) of
    ``hidden_size`` values (``itemsize`` bytes each, the target's dtype; one byte and a float32 scale
    per state in FP8), the target's top-k (ids and log-probabilities, and the tail's log-mass unless
    ``topk_tail`` is off: a store written before it was kept) when stored, + id + loss mask."""
    per_state = hidden_size * itemsize if store_dtype == "target" else hidden_size + SCALE_BYTES
    top = topk * TOPK_TOKEN_BYTES + (TOPK_TAIL_BYTES if topk and topk_tail else 0)
    return num_layers * per_state + top + TOKEN_BYTES


SMALL_ARRAYS = {
    "input_ids": (torch.int32, "int32"),
    "loss_mask": (torch.uint8, "uint8"),  # (torch, zarr dtype)
    "cu_seqlens": (torch.int64, "int64"),
    "sample_ids": (torch.int64, "int64"),
    "topk_ids": (torch.int32, "int32"),  # [T, k], only in a store with topk
    "topk_logprobs": (torch.float16, "float16"),  # [T, k], likewise
    "topk_logtail": (torch.float32, "float32"),  # [T], likewise (stores written since the tail is kept)
    "hidden_scale": (torch.float32, "float32"),  # [T, K], only in an FP8 store
}
TOPK_ARRAYS = ("topk_ids", "topk_logprobs")
TOPK_TAIL_ARRAYS = ("topk_logtail",)
FP8_ARRAYS = ("hidden_scale",)


class ShardError(DflashError):
    """A shard cannot be trusted; the manifest sends its job back to ``pending``."""


class ShardMissingError(ShardError):
    """The shard directory does not exist."""


class ShardCorruptError(ShardError):
    """Checksum mismatch, unreadable metadata, or not the shard the manifest recorded."""


class ShardTruncatedError(ShardError):
    """A chunk file is missing or shorter than the shard metadata says."""


class StoreMismatchError(DflashError):
    """The store was written for another manifest, target, layer set, hidden size or dtype."""


class StoreMissingError(DflashError):
    """No store at the given path."""


class StoreFullError(DflashError):
    """The disk holding the store is full (ENOSPC/EDQUOT); the partial shard was removed."""


@dataclass
class StoreMeta:
    manifest_id: str
    target_id: str
    layer_ids: list[int]
    hidden_size: int
    logical_dtype: str
    compression: str = "none"
    format_version: int = FORMAT_VERSION
    # The target's last decoder layer when its output (before the final norm) is stored as one more
    # slice after the taps on the hidden array's K axis; None: not stored (and every older store).
    last_layer: int | None = None
    # The target's top-k log-probabilities (k, and the temperature they were taken at) when stored
    # (the arrays topk_ids and topk_logprobs); 0 / None: not stored (and every older store).
    topk: int = 0
    topk_temperature: float | None = None
    # Whether the top-k comes with the log of each token's tail mass (the array topk_logtail); every
    # store with a top-k written before it was kept: False (its tail is derived from the fp16 entries).
    topk_tail: bool = False
    # The hidden states' precision on disk: "target" (logical_dtype) or "float8_e4m3fn" (with a
    # float32 scale per token and stored layer, the array hidden_scale); every older store: "target".
    store_dtype: str = "target"

    @property
    def fp8(self) -> bool:
        return self.store_dtype != "target"

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The hidden array's dtype as read: the logical dtype, or float8_e4m3fn."""
        return FP8 if self.fp8 else LOGICAL_DTYPES[self.logical_dtype][0]

    @property
    def stored_layers(self) -> int:
        """The hidden array's K: the taps, and the last layer when stored."""
        return len(self.layer_ids) + (self.last_layer is not None)

    @property
    def arrays(self) -> tuple[str, ...]:
        """The arrays of every shard of this store, in checksum order."""
        top = (TOPK_ARRAYS + (TOPK_TAIL_ARRAYS if self.topk_tail else ())) if self.topk else ()
        return ARRAYS + top + (FP8_ARRAYS if self.fp8 else ())

    def __post_init__(self) -> None:
        self.layer_ids = [int(i) for i in self.layer_ids]
        self.last_layer = None if self.last_layer is None else int(self.last_layer)
        self.topk = int(self.topk or 0)
        self.topk_temperature = float(self.topk_temperature) if self.topk else None
        self.topk_tail = bool(self.topk_tail) and bool(self.topk)
        if self.logical_dtype not in LOGICAL_DTYPES:
            raise ValueError(f"logical_dtype={self.logical_dtype!r}: use one of {sorted(LOGICAL_DTYPES)}")
        if self.store_dtype not in STORE_DTYPES:
            raise ValueError(f"store_dtype={self.store_dtype!r}: use one of {list(STORE_DTYPES)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: use one of {COMPRESSIONS}")


@dataclass
class ShardInfo:
    epoch: int
    job_id: int
    nbytes: int
    checksum: str


@dataclass
class Shard:
    """One job's packed samples, CPU tensors. ``hidden`` has the store's logical dtype, or in an FP8
    store float8_e4m3fn with ``hidden_scale`` (:mod:`dflash_staged.store.fp8`)."""

    epoch: int
    job_id: int
    hidden: torch.Tensor  # [T, K, H]
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] bool
    cu_seqlens: torch.Tensor  # [B+1] int64
    sample_ids: torch.Tensor  # [B] int64
    nbytes: int
    topk_ids: torch.Tensor | None = None  # [T, k] int32, in a store with the target's top-k
    topk_logprobs: torch.Tensor | None = None  # [T, k] float16
    topk_logtail: torch.Tensor | None = None  # [T] float32, where the store keeps the tail
    hidden_scale: torch.Tensor | None = None  # [T, K] float32, in an FP8 store

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0])


@dataclass
class StagedShard:
    """A completely written shard under its temporary name, not yet visible to readers."""

    tmp: Path
    info: ShardInfo
