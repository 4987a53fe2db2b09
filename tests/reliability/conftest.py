"""The fault-injection hooks (``hooks/``) are importable by the tests themselves (e.g. the fake
target's ``expected_hidden``); child processes get them through ``rel_helpers.hooked_env``."""

import sys
from pathlib import Path

HOOKS_DIR = str(Path(__file__).resolve().parent / "hooks")
if HOOKS_DIR not in sys.path:
    sys.path.append(HOOKS_DIR)
