"""The run's metrics: ``RUN_DIR/metrics.jsonl``, one JSON line per optimizer step, and optionally
TensorBoard (``RUN_DIR/tensorboard``).

A line: ``step, loss, lr, acc`` (per block offset), ``tau`` (training tau, implied by the
accuracies), ``tokens``, ``jobs``, ``ranks``, ``buckets``, ``lengths`` (mean sequence length per
shard), ``data_wait_s``, ``step_s``, ``buffer``, ``bucket_choices``. Loss and accuracies are
``null`` on CUDA steps between ``train.log_every`` (they would synchronise the host). On
resume the file is cut back to the checkpoint's step, so every step appears exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_write, remove_dead_temps


class MetricsLog:
    """Appends one line per step (rank 0 only: other ranks hold a disabled log)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DflashError(
                    "--tensorboard needs the tensorboard package: pip install tensorboard"
                ) from None
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, line: dict) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # a torn last line is dropped on resume (truncate)
            raise DflashError(
                f"cannot append step {line.get('step')} to {self.path}: {e.strerror or e}; free space "
                "(or fix the directory) and rerun the same command to resume from the last checkpoint"
            ) from None
        if self._tb is not None and line.get("loss") is not None:
            for key in ("loss", "tau", "lr"):
                self._tb.add_scalar(key, line[key], line["step"])

    def truncate(self, upto: int) -> None:
        """Keep only complete lines with step <= ``upto``, atomically (resume from a checkpoint)."""
        if not self.enabled:
            return
        remove_dead_temps(self.path)  # a rewrite killed midway
        if not self.path.exists():
            return
        keep = []
        for text in self.path.read_text().splitlines():
            try:
                rec = json.loads(text)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= upto:
                keep.append(text)
        atomic_write(self.path, "".join(x + "\n" for x in keep))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
