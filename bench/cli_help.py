"""How long ``dflash --help`` and ``dflash train --help`` take, against a bare interpreter start.

    python bench/cli_help.py [--repeats 7] [--json]

Each command runs in a fresh interpreter (``sys.executable``), ``--repeats`` times, interleaved so that a
change in the machine's load hits every command alike; the median wall time of each is reported, with its
ratio to the baseline ``python -c pass`` measured in the same run. ``python -c "import torch"`` is timed
for reference: what every ``--help`` paid while the CLI modules imported torch at module level. No
timing is asserted anywhere (tests/test_cli_surface.py checks that ``--help`` does not import torch).
With ``--json`` the last line is a JSON object with all results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "dflash --help": ["-m", "dflash_staged", "--help"],
    "dflash train --help": ["-m", "dflash_staged", "train", "--help"],
    "python -c 'import torch'": ["-c", "import torch"],
}


def wall(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for cmd in COMMANDS.values():  # warm the page cache: the first start of each reads its files from disk
        wall(cmd)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(wall(cmd))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median["python -c pass"]
    for name, m in median.items():
        print(
            f"{name:<26} median {m * 1000:7.0f} ms ({min(times[name]) * 1000:.0f}-"
            f"{max(times[name]) * 1000:.0f}), {m / base:5.1f}x the bare interpreter, "
            f"+{(m - base) * 1000:.0f} ms"
        )
    if args.json:
        print(json.dumps({"repeats": args.repeats, "median_s": median, "times_s": times}))


if __name__ == "__main__":
    main()
