"""Extract's notice that nothing drains its window: the window has been full for
:data:`NO_TRAINER_SAY_S` seconds with jobs still to claim and no trainer alive, so extract would wait for
ever. Said once (again only after the window drained or a trainer came and went), naming the command to
start. ``DFLASH_NO_TRAINER_SAY_S`` shortens the wait for tests.
"""

from __future__ import annotations

import os
import time

NO_TRAINER_SAY_S = float(os.environ.get("DFLASH_NO_TRAINER_SAY_S", "120"))


class UndrainedWindow:
    def __init__(self, address: str, store) -> None:
        self.address, self.store = address, store
        self.since: float | None = None
        self.said = False

    def line(self, full: bool, trainer_alive) -> str | None:
        """Called each poll with whether the window is full (with jobs to claim); ``trainer_alive()`` is
        asked only then. The line to say, once, or None."""
        if not full or trainer_alive():
            self.since, self.said = None, False
            return None
        now = time.time()
        self.since = self.since or now
        if self.said or now - self.since < NO_TRAINER_SAY_S:
            return None
        self.said = True
        return (
            f"extract: the window has been full for {now - self.since:.0f} s and no trainer is running on "
            f"{self.address}, so nothing drains it: start `dflash train --manifest {self.address} --store "
            f"{self.store} --out RUN` (or stop this with Ctrl-C; rerunning it resumes)"
        )
