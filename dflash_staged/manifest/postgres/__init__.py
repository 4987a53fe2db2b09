"""The PostgreSQL backend of the manifest (many hosts): :class:`PostgresManifest` (how hosts share
it, in :mod:`.manifest`), claims, leases and publish (:mod:`.claims`), the trainer's transitions and
fence (:mod:`.trainer`), the server's address and reconnects (:mod:`.conn`), the layout and the
samples (:mod:`.schema`) and the registrations (:mod:`.procs`). The contract every backend
implements is :mod:`dflash_staged.manifest.base`."""

from dflash_staged.manifest.postgres.manifest import PostgresManifest

__all__ = ["PostgresManifest"]
