"""The SQLite backend of the manifest (one host): :class:`SqliteManifest` (its layout, in
:mod:`.manifest`) and its state transitions (:mod:`.transitions`). The contract every backend
implements is :mod:`dflash_staged.manifest.base`."""

from dflash_staged.manifest.sqlite.manifest import SqliteManifest

__all__ = ["SqliteManifest"]
