"""Test-only fault injection for subprocesses: active only when DFLASH_TEST_HOOKS is set.

The reliability tests put this directory on PYTHONPATH, so every Python process they start
(the CLI, and the extract workers it spawns) runs this at startup. See dflash_fault_hooks.
"""

import os

if os.environ.get("DFLASH_TEST_HOOKS"):
    import dflash_fault_hooks

    dflash_fault_hooks.install()
