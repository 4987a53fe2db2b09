"""What one ``dflash train`` run is asked to do (its command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainOptions:
    manifest: str | Path  # a manifest address (see dflash_staged.manifest)
    store: Path
    out: Path
    replay: bool = False
    keep_shards: bool = False
    order_from: Path | None = None
    passes: int = 1
    overrides: dict = field(default_factory=dict)  # {section: {key: value}}
    device: str | None = None
    verify: bool = True
    max_steps: int | None = None  # stop (with a checkpoint) once this many steps are done
    total_steps: int | None = None  # the lr/noise schedule's length [default: the data's]
    tensorboard: bool = False
    init_from: Path | None = None  # start a new run from this run's or checkpoint's drafter weights
    # Stop (with a checkpoint) once this many seconds of the loop have passed; the schedule's length is
    # then refitted each step to the steps the time left affords (train.loop.TimeBudget)
    time_budget_s: float | None = None
    node_local: bool = False  # a store per node: each rank trains on its node's shards (manifest.layout)
