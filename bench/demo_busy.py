"""The README demo from a fresh clone on a host that becomes busier halfway: does it still end inside
its budget, with ``tau=`` on its last line?

It clones this checkout (its uncommitted files too, as ``bench/gpu_rehearsal.copy_worktree`` copies
them) into a temporary directory, links this checkout's ``.venv`` and ``.cache`` there (the set-up and
the target's download are the same code either way, and their minutes are not what this measures;
``--fresh-venv`` builds both anew), runs ``bin/demo`` with ``DFLASH_DEMO_BUDGET_S``, and as soon as
the demo announces its replay starts ``--hogs`` busy processes (one per core by default) that run to
the end: the replay and the eval then get a fraction of the CPU they were sized for. It prints the
demo's output, then one JSON line: the budget, the wall time, the replay's planned and finished
steps, the eval's prompts, tau, and whether it ended in time.

    .venv/bin/python bench/demo_busy.py [--budget-s 900] [--hogs 2] [--out bench/results/demo_busy.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hog() -> None:  # pragma: no cover - a busy loop until killed
    x = 0
    while True:
        x += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=int, default=900)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--fresh-venv", action="store_true", help="build .venv and .cache anew in the clone")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demo_busy.json")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_rehearsal import copy_worktree

    work = Path(tempfile.mkdtemp(prefix="demo-busy-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    copy_worktree(ROOT, clone)
    if not a.fresh_venv:
        for name in (".venv", ".cache"):
            if (ROOT / name).exists():
                (clone / name).symlink_to(ROOT / name)
    env = dict(os.environ, DFLASH_DEMO_BUDGET_S=str(a.budget_s), PYTHONUNBUFFERED="1")
    t0 = time.time()
    p = subprocess.Popen(
        ["bash", "bin/demo"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    hogs: list[mp.Process] = []
    lines, hog_at = [], None
    for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
        if hog_at is None and line.startswith("[demo] replay:"):
            hog_at = time.time() - t0
            hogs = [mp.Process(target=hog, daemon=True) for _ in range(a.hogs)]
            for h in hogs:
                h.start()
    rc = p.wait()
    wall = time.time() - t0
    for h in hogs:
        h.kill()
    text = "\n".join(lines)
    tau = re.search(r"^tau=([\d.]+) ", text, re.M)
    planned = re.search(r"replay: (\d+) s of training \(about (\d+) steps", text)
    done = re.search(r"\[demo\] replay: (\d+) steps", text)
    prompts = re.search(r"\[demo\] eval: (\d+) held-out prompts \(of (\d+) planned\)", text)
    res = {
        "budget_s": a.budget_s,
        "wall_s": round(wall, 1),
        "in_budget": wall <= a.budget_s,
        "rc": rc,
        "hogs": a.hogs,
        "hogs_started_at_s": None if hog_at is None else round(hog_at, 1),
        "replay_budget_s": int(planned[1]) if planned else None,
        "replay_steps_planned": int(planned[2]) if planned else None,
        "replay_steps_done": int(done[1]) if done else None,
        "eval_prompts": [int(prompts[1]), int(prompts[2])] if prompts else None,
        "tau": float(tau[1]) if tau else None,
        "last_line": lines[-1] if lines else "",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if rc == 0 and res["in_budget"] and res["tau"] else 1


if __name__ == "__main__":
    sys.exit(main())
