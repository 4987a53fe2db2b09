"""The manifest: the single source of truth for job state, shared by every stage.

The job state machine is specified in :mod:`dflash_staged.manifest.states`; the operations
every stage uses are those of :class:`Manifest` (:mod:`dflash_staged.manifest.base`), whose
``open``/``create`` pick the backend from the address: a directory is the SQLite manifest of one
host (:mod:`.sqlite`), ``postgresql://USER@HOST:PORT/DB#NAME`` a manifest that many hosts share
(:mod:`.postgres`). No code outside this package reads or writes job state.
"""

from dflash_staged.manifest.base import Manifest
from dflash_staged.manifest.build import ONE_HOST
from dflash_staged.manifest.postgres import PostgresManifest  # (registers postgresql:// addresses)
from dflash_staged.manifest.sqlite import SqliteManifest  # (registers the embedded backend)
from dflash_staged.manifest.states import (
    EXTRACTED,
    FORMAT_VERSION,
    GROUPS,
    IN_WINDOW,
    STATES,
    TO_EXTRACT,
    TRAINED,
    ClaimResult,
    Job,
    ManifestError,
    ManifestMismatchError,
    Proc,
    TrainerBusyError,
    diff_dicts,
    group_counts,
    plan_identity,
)

__all__ = [
    "EXTRACTED",
    "FORMAT_VERSION",
    "GROUPS",
    "IN_WINDOW",
    "ONE_HOST",
    "STATES",
    "TO_EXTRACT",
    "TRAINED",
    "ClaimResult",
    "Job",
    "Manifest",
    "ManifestError",
    "ManifestMismatchError",
    "PostgresManifest",
    "Proc",
    "SqliteManifest",
    "TrainerBusyError",
    "diff_dicts",
    "group_counts",
    "plan_identity",
]
