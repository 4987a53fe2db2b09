"""The hidden-state shard store: extract writes shards, train reads and deletes them.

The on-disk layout is specified in :mod:`dflash_staged.store.shard_store`.
"""

from dflash_staged.store.cleanup import Remover
from dflash_staged.store.meta import (
    ARRAYS,
    COMPRESSIONS,
    FORMAT_VERSION,
    LOGICAL_DTYPES,
    Shard,
    ShardCorruptError,
    ShardError,
    ShardInfo,
    ShardMissingError,
    ShardTruncatedError,
    StagedShard,
    StoreFullError,
    StoreMeta,
    StoreMismatchError,
    StoreMissingError,
    bytes_per_token,
)
from dflash_staged.store.shard_store import ShardStore

__all__ = [
    "ARRAYS",
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "LOGICAL_DTYPES",
    "Remover",
    "Shard",
    "ShardCorruptError",
    "ShardError",
    "ShardInfo",
    "ShardMissingError",
    "ShardStore",
    "ShardTruncatedError",
    "StagedShard",
    "StoreFullError",
    "StoreMeta",
    "StoreMismatchError",
    "StoreMissingError",
    "bytes_per_token",
]
