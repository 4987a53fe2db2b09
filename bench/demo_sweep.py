"""The demo's recipe by measurement: replay the kept store at a fixed wall-clock budget per setting,
then held-out tau for each (greedy, and at the ``--temperatures`` given: ``0,1`` adds T = 1 with
top-p 0.95 and top-k 20, the DFlash2 release's protocol).

For every setting of the grid (``--set`` overrides of ``train`` / ``drafter``, e.g. anchors per
sequence, gamma, the learning rate and its schedule, the initialisation), it

1. measures the replay's step time with that setting (a short probe run),
2. replays ``budget / step time`` steps (``--max-steps N --total-steps N``: the schedule fits the
   budget; ``--probe-first`` probes every setting before any run, so that later load on the machine
   changes no step count; a setting's ``steps`` fixes them instead, for equal steps; its ``manifest``
   and ``store`` replay another kept store), on the same kept shards (``runs/demo`` after
   ``./bin/demo``, or ``--manifest/--store``),
3. runs ``dflash eval`` on the first ``--eval-prompts`` held-out prompts.

It writes ``OUT.json`` (one record per setting: overrides, steps, seconds, tau, per-position
acceptance) and ``OUT.png`` (tau per setting), and prints a table. All settings run in one
process tree on the same machine one after the other, so their taus compare; on a shared machine
the step times (and so the steps each budget buys) are noisy: say so next to the figures.

    .venv/bin/python bench/demo_sweep.py --budget-s 120 --eval-prompts 16 [--grid grid.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GRID = [
    {},
    {"drafter.init": "target_top"},
    {"drafter.init": "target_top", "train.gamma": 4.0},
    {"drafter.init": "target_top", "train.gamma": 4.0, "train.num_anchors": 24},
    {"drafter.init": "target_top", "train.gamma": 4.0, "train.num_anchors": 24, "train.lr_schedule": "wsd"},
    {"drafter.init": "target_top", "train.gamma": 4.0, "train.num_anchors": 24, "train.lr": 2e-3},
]


def dflash(*args, env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_staged", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def toml_value(v) -> str:
    """A value as ``--set`` reads it (TOML): a dict is an inline table, ``{ ce = 0.1, tv = 0.9 }``."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


OWN_KEYS = ("init_from", "manifest", "store", "steps")  # a setting's keys that are not --set overrides


def sets(overrides: dict) -> list[str]:
    """``--set`` flags; the key ``init_from`` (a run directory) becomes ``--init-from``; ``manifest`` and
    ``store`` replay another kept store, ``steps`` fixes the steps (no probe, no budget)."""
    flags = [x for k, v in overrides.items() if k not in OWN_KEYS for x in ("--set", f"{k}={toml_value(v)}")]
    return flags + (
        ["--init-from", str(Path(overrides["init_from"]).resolve())] if "init_from" in overrides else []
    )


def peak_rss(args, env: dict) -> tuple[subprocess.CompletedProcess, int]:
    """``dflash ARGS`` to completion and its peak resident memory in bytes (VmHWM, polled)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "dflash_staged", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    peak = 0
    status = Path(f"/proc/{p.pid}/status")
    while p.poll() is None:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
            peak = max(peak, int(line.split()[1]) * 1024)
        except (OSError, StopIteration):
            pass
        time.sleep(0.5)
    out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), peak


def step_seconds(metrics: Path) -> float:
    times = [json.loads(x)["step_s"] for x in metrics.read_text().splitlines()][2:]  # warm steps only
    return statistics.median(times)


def replay_args(overrides: dict, a) -> list:
    return [
        "train",
        "--replay",
        "--manifest",
        Path(overrides.get("manifest", a.manifest)).resolve(),
        "--store",
        Path(overrides.get("store", a.store)).resolve(),
        "--device",
        "cpu",
        "--passes",
        a.max_passes,
        *sets(overrides),
    ]


def probe(i: int, overrides: dict, a, work: Path) -> float:
    """The replay's median warm step time with this setting (a short run)."""
    out = work / f"probe{i}"
    r = dflash(
        *replay_args(overrides, a),
        "--out",
        out,
        "--max-steps",
        a.probe_steps,
        "--set",
        "train.checkpoint_every=100000",
        env={"OMP_NUM_THREADS": str(a.threads)},
    )
    if r.returncode:
        raise SystemExit(f"setting {overrides}: the probe failed:\n{r.stderr[-2000:]}")
    return step_seconds(out / "metrics.jsonl")


def probe_first(grid: list[dict], a, work: Path) -> dict[int, float]:
    """``--probe-first``: every setting's step time, measured back to back before any run (one probe for
    settings that differ only in ``train.seed``), so that a busy machine later changes no step count."""
    seen: dict[str, float] = {}
    out = {}
    for i, o in enumerate(grid):
        if "steps" in o:
            continue
        key = json.dumps({k: v for k, v in o.items() if k != "train.seed"}, sort_keys=True)
        if key not in seen:
            seen[key] = probe(i, o, a, work)
            print(f"probe: {seen[key]:.3f} s a step  {o}", flush=True)
        out[i] = seen[key]
    return out


def run_point(i: int, overrides: dict, a, work: Path, step_s: float | None = None) -> dict:
    base = replay_args(overrides, a)
    env = {"OMP_NUM_THREADS": str(a.threads)}
    if "steps" in overrides:
        steps = int(overrides["steps"])
    else:
        step_s = step_s or probe(i, overrides, a, work)
        steps = max(a.probe_steps, int(a.budget_s / step_s))
    run = work / f"run{i}"
    t0 = time.perf_counter()
    r, rss = peak_rss(
        [
            *base,
            "--out",
            run,
            "--max-steps",
            steps,
            "--total-steps",
            steps,
            "--set",
            f"train.warmup_ratio={min(0.3, 30 / steps):.4f}",
            "--set",
            "train.checkpoint_every=100000",
        ],
        env,
    )
    train_s = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"setting {overrides}: the replay failed:\n{r.stderr[-2000:]}")
    done = len((run / "metrics.jsonl").read_text().splitlines())
    r = dflash(
        "eval",
        "--drafter",
        run,
        "--target",
        a.config,
        "--prompts",
        a.prompts,
        "--limit",
        a.eval_prompts,
        "--max-new-tokens",
        a.max_new_tokens,
        "--device",
        "cpu",
        "--no-baseline",
        "--json",
        "--temperature",
        a.temperatures,
        "--top-p",
        a.top_p,
        "--top-k",
        a.top_k,
        env=env,
    )
    if r.returncode:
        raise SystemExit(f"setting {overrides}: eval failed:\n{r.stderr[-2000:]}")
    ev = json.loads(r.stdout)
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-10:]
    walk = [x["walk_tau"] for x in last if x.get("walk_tau") is not None]
    by_t = {
        str(x["sampling"].get("temperature", 0)): {
            "tau": x["tau"],
            "per_position_acceptance": x["per_position_acceptance"][:4],
        }
        for x in ev.get("runs") or [ev]
    }
    return {
        "by_temperature": by_t,
        "train_walk_tau_end": round(statistics.mean(walk), 3) if walk else None,
        "overrides": overrides,
        "probe_step_s": None if step_s is None else round(step_s, 3),
        "step_s": round(step_seconds(run / "metrics.jsonl"), 3),
        "peak_rss_bytes": rss,
        "steps": done,
        "train_s": round(train_s, 1),
        "tau": ev["tau"],
        "tau_per_prompt_mean": ev.get("tau_per_prompt_mean"),
        "per_position_acceptance": ev["per_position_acceptance"][:4],
        "train_loss_end": round(statistics.mean(x["loss"] for x in last if x["loss"] is not None), 3),
        "train_tau_end": round(statistics.mean(x["tau"] for x in last if x["tau"] is not None), 3),
    }


def plot(results: list[dict], path: Path) -> None:
    """Held-out tau per setting: one bar per eval temperature (greedy first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items()) or "as configured"
        for r in results
    ]
    temps = list(results[0]["by_temperature"])
    h = 0.8 / len(temps)
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(results) * len(temps)))
    top = 1.0
    for j, t in enumerate(temps):
        taus = [r["by_temperature"][t]["tau"] for r in results]
        top = max(top, *taus)
        ys = [y + j * h for y in range(len(results))]
        name = "greedy" if float(t) == 0 else f"T={t}"
        ax.barh(ys, taus, height=h, label=name)
        for y, r, tau in zip(ys, results, taus):
            ax.text(tau, y, f" {tau:.3f} ({r['steps']} steps)", va="center", fontsize=8)
    ax.set_yticks([y + h * (len(temps) - 1) / 2 for y in range(len(results))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(1.0, top * 1.08)
    ax.set_xlabel("held-out tau (tokens per verify step)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--demo-dir", type=Path, default=ROOT / "runs" / "demo", help="holds manifest/ and store/"
    )
    ap.add_argument("--manifest", type=Path, default=None)
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-demo.toml")
    ap.add_argument("--prompts", type=Path, default=ROOT / "demo" / "data" / "heldout.jsonl")
    ap.add_argument("--grid", type=Path, default=None, help="JSON list of {section.key: value} override sets")
    ap.add_argument("--budget-s", type=float, default=120.0, help="training wall-clock per setting")
    ap.add_argument("--probe-steps", type=int, default=8)
    ap.add_argument(
        "--probe-first",
        action="store_true",
        help="probe every setting before any run (a busy machine then changes no step count)",
    )
    ap.add_argument("--max-passes", type=int, default=60)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0", help="eval temperatures, comma-separated (0 = greedy)")
    ap.add_argument("--top-p", type=float, default=0.95, help="eval top-p at T > 0 (the DFlash2 protocol's)")
    ap.add_argument("--top-k", type=int, default=20, help="eval top-k at T > 0 (the DFlash2 protocol's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demo_sweep")
    ap.add_argument("--keep-runs", type=Path, default=None, help="keep the run directories here (run0, ...)")
    a = ap.parse_args()
    a.manifest, a.store = a.manifest or a.demo_dir / "manifest", a.store or a.demo_dir / "store"
    for k in ("manifest", "store", "config", "prompts", "out"):  # the commands run from the repository root
        setattr(a, k, getattr(a, k).resolve())
    grid = json.loads(a.grid.read_text()) if a.grid else DEFAULT_GRID
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    if a.keep_runs:
        a.keep_runs.mkdir(parents=True, exist_ok=True)
    tmp = contextlib.nullcontext(str(a.keep_runs.resolve())) if a.keep_runs else None
    with tmp or tempfile.TemporaryDirectory(prefix="demo-sweep-") as work:
        probed = probe_first(grid, a, Path(work)) if a.probe_first else {}
        for i, overrides in enumerate(grid):
            rec = run_point(i, overrides, a, Path(work), probed.get(i))
            results.append(rec)
            taus = " ".join(f"T={t}: {v['tau']:.3f}" for t, v in rec["by_temperature"].items())
            walk = f"  train walk tau {rec['train_walk_tau_end']}" if rec["train_walk_tau_end"] else ""
            print(
                f"{taus}  {rec['steps']:>5} steps  {rec['train_s']:>6.0f} s  step {rec['probe_step_s']} s  "
                f"train tau {rec['train_tau_end']}{walk}  "
                f"acc {' '.join(f'{x:.2f}' for x in rec['per_position_acceptance'])}  {overrides}",
                flush=True,
            )
            a.out.with_suffix(".json").write_text(
                json.dumps({"budget_s": a.budget_s, "results": results}, indent=1)
            )
    plot(results, a.out.with_suffix(".png"))
    print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
