"""bench/recipe_step.py (the GPU smoke's training step at the recipe's shapes) runs on CPU at small
widths, through the trainer's parts, splitting a step by the row budget."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_step_runs_small_on_cpu():
    args = [
        "--device",
        "cpu",
        "--small",
        "--steps",
        "1",
        "--tokens",
        "512",
        "--seq-len",
        "64",
        "--rows",
        "1024",
    ]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recipe_step.py"), *args, "--checkpointing"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # 8 sequences of 64 tokens, 32 anchors each x block 16 = 512 rows each: two a microbatch
    assert res["row_budget"] == 1024 and res["microbatches"] == 4
    assert res["tokens_per_s"] > 0 and math.isfinite(res["loss"]) and res["estimated_peak_gib"] > 0
