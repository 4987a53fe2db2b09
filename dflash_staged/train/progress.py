"""The trainer's one-line status on stderr: a tqdm bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    """One status line on stderr: a tqdm bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool, start: int = 0):
        self.enabled = enabled
        self.bar = None
        self.last = 0.0
        self.total = total
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr)

    def waiting(self, ready: int, need: int, one_bucket: bool = False) -> None:
        self._say(
            f"waiting for shards: {ready}/{need} ready"
            + (", all of one length bucket" if one_bucket else ""),
            force=False,
        )

    def step(self, step: int, loss, tok_s: float, buf: int, cap: int) -> None:
        msg = f"loss {loss:.4f}" if loss is not None else "loss -"
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(f"{msg} | {tok_s:,.0f} tok/s | buffer {buf}/{cap}")
        else:
            self._say(
                f"step {step}/{self.total} | {msg} | {tok_s:,.0f} tok/s | buffer {buf}/{cap}", force=False
            )

    def _say(self, text: str, force: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(text if text.startswith("waiting") else "train")
            self.bar.refresh()
            return
        if force or time.time() - self.last > 2.0:
            print(f"train: {text}", file=sys.stderr, flush=True)
            self.last = time.time()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
