"""The hidden-state shard store; its on-disk layout is specified in :mod:`dflash_staged.store.layout`."""

from dflash_staged.store.layout import (ARRAYS, COMPRESSIONS, FORMAT_VERSION, LOGICAL_DTYPES, Shard,  # noqa: F401
                                        ShardCorruptError, ShardError, ShardInfo, ShardMissingError, ShardStore,
                                        ShardTruncatedError, StagedShard, StoreFullError, StoreMeta,
                                        StoreMismatchError, StoreMissingError)
