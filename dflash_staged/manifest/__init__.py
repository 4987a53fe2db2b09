"""The manifest: job state shared by every stage. The state machine is specified in
:mod:`dflash_staged.manifest.sqlite`; this package is the only code that reads or writes it."""

from dflash_staged.manifest.build import FORMAT_VERSION, ONE_HOST, ManifestError  # noqa: F401
from dflash_staged.manifest.sqlite import (IN_WINDOW, STATES, ClaimResult, Job, Manifest,  # noqa: F401
                                           ManifestMismatchError, TrainerBusyError)
