"""``dflash node --split auto``: measure both stages on this node, choose the split, build the layout.

Contract of :func:`auto_node_layout`, in order:

1. **Devices.** ``--devices``: the node's GPUs as ``--extract-gpus`` takes them (``0-7``; indices
   into ``CUDA_VISIBLE_DEVICES`` when set), by default every visible GPU; or ``cpu,cpu,...`` (a
   CPU node, each device a share of the cores: how CI runs it). Refused before anything runs: fewer
   than ``--tp`` + 1 devices, or a run directory that already holds a checkpoint (a resumed run
   needs its trainer's number of ranks: give the split by hand).
2. **Plan** (``dflash plan``, output prefixed ``[plan]``) unless the manifest holds this plan.
3. **Extract rate.** The real ``dflash extract`` on the run's manifest and store with one worker
   (the node's first device, or its first ``--tp`` group; output prefixed ``[probe extract]``),
   stopped with SIGTERM (its worker finishes its job or gives the claim back) once it has written
   ``probe_jobs`` jobs (at most the jobs left and the window), or :data:`MEASURE_S` after its first,
   or when no job came for a while (a stall: no job while the window is full). The rate is the real
   tokens of the jobs its own workers published after the first (another extract may share the
   manifest), over the time from the first's publication to the last's (the first job pays the
   target's load and warm-up), seen by reading the manifest every :data:`POLL_S`. At least two jobs
   must be left to extract, and the window must have room for two: a full window (a previous run's
   trainer stopped before releasing its shards) is refused at once, naming the remedy. **These jobs
   are real jobs of the run**: they stay ``written`` and the run's trainer consumes them like any
   other, so every job is still extracted once and consumed once; nothing is discarded.
4. **Train rate.** One trainer rank (:mod:`dflash_staged.launch.probe_train`, on the node's last
   device; output prefixed ``[probe train]``) times optimizer steps on those shards at the run's
   config (``--set`` overrides among the train arguments apply), reading them without taking or
   consuming them (a damaged one is skipped and named: the run's trainer has it re-extracted).
5. **Choice** (:func:`dflash_staged.split.choose_split`, with ``--train-scaling``; splits whose
   trainer ranks the window cannot serve (:mod:`dflash_staged.manifest.window`) are no candidates,
   and are named): printed
   as ``[split]`` lines: the measured rates, every candidate's throughput, the chosen split, the
   expected throughput and idle shares, and a side too slow at every split. The layout is the
   node layout of that split (extract takes the first devices, train the rest) and, unless
   ``--target-tok-s`` is given, its disk arithmetic takes the measured extract rate.
   ``--dry-run`` then prints the commands and starts nothing more; otherwise the run starts.

A signal during the probes stops the probe's child and exits 128 + the signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_staged import split as splitting
from dflash_staged.children import Children, CommandChild
from dflash_staged.errors import DflashError
from dflash_staged.launch.multinode import MULTINODE
from dflash_staged.launch.probe_train import RESULT
from dflash_staged.launch.processes import (
    Layout,
    base_env,
    cpu_node_layout,
    cpu_threads,
    dflash_cmd,
    gpu_indices,
    node_layout,
    parse_gpus,
    plan_cmd_if_needed,
)
from dflash_staged.launch.supervise import PY

MEASURE_S = 120.0  # the extract probe stops this long after its first job at the latest
FIRST_JOB_S = 3600.0  # ... and fails when no job is written this long after its start
STALL_S = 5.0  # no new job for max(this, 4 x the mean interval): the window is full
POLL_S = 0.02  # a GPU job takes ~0.5 s or more: each end of the timed span is within 2% of one
STOP_S = 120.0  # a stopped probe child gets this long to exit before it is killed


@dataclass
class NodeDevices:
    """The devices ``--split auto`` splits: GPU indices (as ``--extract-gpus`` takes them) or cpus."""

    kind: str  # "cuda" or "cpu"
    ids: list[str]

    def physical(self, ids: list[str]) -> str:
        """CUDA_VISIBLE_DEVICES for some of the GPUs."""
        return ",".join(parse_gpus(",".join(ids), "--devices"))


def node_devices(text: str | None) -> NodeDevices:
    """``--devices``: None = every visible GPU; ``0-7``; ``cpu,cpu,...``."""
    if text is None:
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise DflashError(
                "--split auto: no GPU is visible; give the node's devices with --devices (e.g. "
                "--devices cpu,cpu,cpu,cpu for a CPU run)"
            )
        return NodeDevices("cuda", [str(i) for i in range(n)])
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words and all(w == "cpu" for w in words):
        return NodeDevices("cpu", words)
    ids = gpu_indices(text)
    if not ids or len(set(ids)) != len(ids):
        raise DflashError(
            f"--devices {text!r}: give distinct GPU indices (0-7, 0,1,2,3) or cpu,cpu,... for a CPU node"
        )
    parse_gpus(text, "--devices")  # indices that CUDA_VISIBLE_DEVICES does not show are refused now
    return NodeDevices("cuda", ids)


class _Probes:
    """The probes' output, their children and the signals that stop them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.child: CommandChild | None = None
        self.children = Children(lambda: [self.child] if self.child else [])

    def say(self, text: str, who: str = "split") -> None:
        with self.lock:
            print(f"[{who}] {text}", flush=True)

    def check_signals(self) -> None:
        if self.children.signals:
            self.say(f"{signal.Signals(self.children.signals[0]).name}: stopping the probe")
            self.finish()
            sys.exit(128 + self.children.signals[0])

    def start(self, name: str, cmd: list[str], env: dict[str, str], on_line=None) -> CommandChild:
        self.say(f"{name}: " + " ".join(map(str, cmd)))
        self.child = CommandChild(
            name,
            cmd,
            {**os.environ, "PYTHONUNBUFFERED": "1", **env},
            on_line or (lambda s: self.say(s, name)),
        )
        self.children.catch_up()
        self.child.reader.start()
        return self.child

    def finish(self) -> int | None:
        """Stop the child (if running), wait for it and its output; its exit code."""
        c = self.child
        if c is None:
            return None
        if c.alive():
            c.stop()
            c.wait(STOP_S)
        if c.alive():
            c.kill()
            c.wait(5)
        c.reader.join(timeout=5)
        self.child = None
        return c.code


def _run_plan(p: _Probes, cmd: list[str]) -> None:
    c = p.start("plan", cmd, base_env())
    while c.alive():
        time.sleep(0.1)
        p.check_signals()
    if p.finish() != 0:
        raise DflashError(f"--split auto: the plan failed (exit {c.exit_code()}); see its [plan] lines")


def window_room(m, o: dict) -> tuple[int, str]:
    """How many more jobs extract's window admits now (shards, and bytes at the largest pending job's
    size once the bytes per token are known), and the window's use in words."""
    from dflash_staged.manifest.status import human_bytes
    from dflash_staged.procs import HOST

    node = HOST if o.get("node_local") else None  # node-local stores: this node's window
    window, wb, used = o["window"] or m.config.extract.window, o["window_bytes"] or 0, m.window(node)
    room = window - used["shards"]
    words = f"{used['shards']} of {window} shards"
    bpt = int(m.meta.get("bytes_per_token") or 0)
    if wb:
        words += f", {human_bytes(used['bytes'])} of {human_bytes(wb)}"
        biggest = max((j.real_tokens for j in m.jobs("pending")), default=0) * bpt
        if biggest:
            room = min(room, max(0, wb - used["bytes"]) // biggest)
    return room, words


def measure_extract(p: _Probes, manifest, store: Path, dev: NodeDevices, o: dict, jobs: int) -> dict:
    """Step 3 of the module docstring: {'tok_s', 'jobs', 'tokens', 'seconds', 'load_s'}."""
    from dflash_staged.manifest import Manifest
    from dflash_staged.procs import HOST, descendants

    tp = o["tp"]
    group = dev.ids[:tp]
    env = base_env()
    if dev.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = dev.physical(group)
        devices = ",".join(f"cuda:{i}" for i in range(tp))
    else:
        env["OMP_NUM_THREADS"] = str(cpu_threads(len(dev.ids)))
        devices = ",".join(["cpu"] * tp)
    cmd = dflash_cmd("extract", "--manifest", manifest, "--store", store, "--devices", devices)
    cmd += ["--tp", str(tp)] if tp > 1 else []
    cmd += ["--window", str(o["window"])] if o["window"] is not None else []
    cmd += ["--window-bytes", str(o["window_bytes"])] if o["window_bytes"] is not None else []
    cmd += ["--allow-slow-kernels"] if o["allow_slow_kernels"] else []
    cmd += ["--node-local"] if o.get("node_local") else []
    with Manifest.open(manifest, readonly=True) as m:
        left = m.progress()["jobs"]["to_extract"]
        if left < 2:
            raise DflashError(
                f"--split auto: {left} job(s) left to extract in {m.address}: too few to measure extract; "
                "give --extract-gpus and --train-gpus"
            )
        room, used = window_room(m, o)
        if room < 2:
            raise DflashError(
                f"--split auto: extract's window is full ({used} claimed, written or consumed but not "
                "released: a previous run's trainer stopped before releasing them, or another extract "
                "holds them) and the extract probe needs room for two jobs. Resume that run's trainer "
                f"(dflash train --manifest {m.address} --store {store} --out <its run>) to drain them, or "
                "give --extract-gpus and --train-gpus; a larger --window also makes room"
            )
        want = min(jobs, left, room)
        c = p.start("probe extract", cmd, env)
        pids: set[int] = set()  # the probe's own workers: only their jobs count (others may share m)
        marks: list[tuple[float, int, int]] = []  # (when, jobs, tokens) each time more jobs are seen written
        t0 = time.monotonic()
        while True:
            time.sleep(POLL_S)
            p.check_signals()
            pids.update(descendants(c.pid))
            (n, tokens), now = m.written_by(HOST, pids), time.monotonic()
            if n > (marks[-1][1] if marks else 0):
                marks.append((now, n, tokens))
            if (n >= want and len(marks) >= 2) or not c.alive():
                break
            if (marks and now - marks[0][0] > MEASURE_S) or (not marks and now - t0 > FIRST_JOB_S):
                break
            quiet = now - (marks[-1][0] if marks else t0)
            if len(marks) >= 2:
                interval = (marks[-1][0] - marks[0][0]) / (len(marks) - 1)
                if quiet > max(STALL_S, 4 * interval):
                    break
            if quiet > STALL_S and window_room(m, o)[0] <= 0:
                break  # no job while the window is full: a stall, not a slow target
    p.finish()
    with Manifest.open(manifest, readonly=True) as m:  # with the job its worker finished once stopped
        written = m.written_by(HOST, pids)[0]
        room, used = window_room(m, o)
    if len(marks) < 2:
        why = (
            f"exited with code {c.exit_code()}"
            if not c.stopped
            else f"stopped after {time.monotonic() - t0:.0f} s"
        )
        full = f"; extract's window is full ({used})" if room <= 0 else ""
        raise DflashError(
            f"--split auto: the extract probe {why} having written {written} job(s){full}; it needs two to "
            "measure (see its [probe extract] lines)"
        )
    if c.failed:
        raise DflashError(f"--split auto: the extract probe failed (exit {c.exit_code()}); see its lines")
    (ta, ja, ka), (tb, jb, kb) = marks[0], marks[-1]
    return {
        "tok_s": (kb - ka) / (tb - ta),
        "jobs": written,
        "timed_jobs": jb - ja,
        "tokens": kb - ka,
        "seconds": tb - ta,
        "load_s": ta - t0,
    }


def measure_train(p: _Probes, manifest, store: Path, dev: NodeDevices, o: dict, jobs: int) -> dict:
    """Step 4 of the module docstring: probe_train's result."""
    env = base_env()
    last = dev.ids[-1:]
    if dev.kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = dev.physical(last)
    else:
        env["OMP_NUM_THREADS"] = str(cpu_threads(len(dev.ids)))
    cmd = [PY, "-m", "dflash_staged.launch.probe_train", "--manifest", str(manifest), "--store", str(store)]
    cmd += ["--device", dev.kind, "--shards", str(jobs)]
    for s in _sets(o["train_args"]):
        cmd += ["--set", s]
    result: list[dict] = []

    def on_line(line: str) -> None:
        if line.startswith(RESULT):
            result.append(json.loads(line[len(RESULT) :]))
        else:
            p.say(line, "probe train")

    c = p.start("probe train", cmd, env, on_line)
    while c.alive():
        time.sleep(0.1)
        p.check_signals()
    p.finish()
    if c.code != 0 or not result:
        raise DflashError(f"--split auto: the train probe failed (exit {c.exit_code()}); see its lines")
    return result[0]


def _sets(train_args) -> list[str]:
    """The ``--set`` values among the train arguments."""
    out, args = [], list(train_args)
    for i, a in enumerate(args):
        if a == "--set" and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith("--set="):
            out.append(a[len("--set=") :])
    return out


def window_rule(manifest, o: dict):
    """``(extract workers, train ranks) -> the window rule's error or None`` for this run's window
    (:mod:`dflash_staged.manifest.window`): a split the real extract and train would refuse is no
    candidate."""
    from dflash_staged.manifest import Manifest
    from dflash_staged.manifest.window import window_check

    with Manifest.open(manifest, readonly=True) as m:
        cfg, bpt = m.config, int(m.meta.get("bytes_per_token") or 0)
        window, wb = o["window"] or cfg.extract.window, o["window_bytes"] or 0
        largest = max((j.real_tokens for j in m.jobs()), default=0) * bpt if wb else 0
    return lambda workers, ranks: window_check(
        cfg, window, workers, ranks, window_bytes=wb, shard_bytes_max=largest
    )[0]


def auto_node_layout(o: dict, devices: str | None, probe_jobs: int, scaling: float) -> Layout:
    """The module docstring; ``o`` holds ``dflash node``'s other options by name."""
    from dflash_staged.train.checkpoint import latest_checkpoint

    dev = node_devices(devices)
    tp, n = o["tp"], len(dev.ids)
    splitting.candidates(n, tp, 1.0, 1.0, scaling)  # refuse an impossible node before any work
    workdir = Path(o["workdir"])
    ck = latest_checkpoint(workdir / "run") if (workdir / "run").is_dir() else None
    if ck is not None:
        raise DflashError(
            f"--split auto: {workdir / 'run'} holds checkpoint {ck.name}: a resumed run needs the "
            "trainer ranks it was written with; give --extract-gpus and --train-gpus"
        )
    manifest, store = o["manifest"] or workdir / "manifest", workdir / "store"
    p = _Probes()
    with p.children.forwarding(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            plan = plan_cmd_if_needed(Path(o["config"]), Path(o["data"]), manifest, o["epochs"], o["seed"])
            if plan is not None:
                _run_plan(p, plan)
            ex = measure_extract(p, manifest, store, dev, o, probe_jobs)
            tr = measure_train(p, manifest, store, dev, o, probe_jobs)
        finally:
            p.finish()
    where = "GPU" if dev.kind == "cuda" else "cpu device"
    p.say(
        f"measured: extract {ex['tok_s']:,.0f} tok/s per worker ({ex['tokens']:,} tokens of "
        f"{ex['timed_jobs']} job(s) in {ex['seconds']:.2f} s after a first job at {ex['load_s']:.1f} s, "
        f"on {tp} {where}(s)); "
        f"train {tr['tok_s']:,.0f} tok/s per rank ({tr['tokens']:,} tokens in {tr['steps']} timed step(s), "
        f"{tr['seconds']:.2f} s, after {tr['warmup_steps']} warm-up step(s), on {tr['device']})"
    )
    p.say(
        f"the probe's {ex['jobs']} job(s) are jobs of the run: they stay written and the trainer "
        "consumes them"
    )
    rule = window_rule(manifest, o)
    cands = splitting.candidates(n, tp, ex["tok_s"], tr["tok_s"], scaling, rule)
    p.say("tok/s by split (extract + train devices): " + splitting.table(cands))
    for c, why in splitting.refused(n, tp, rule):
        p.say(f"not {c}: {why}")
    chosen = splitting.choose_split(n, tp, ex["tok_s"], tr["tok_s"], scaling, rule)
    for line in chosen.lines():
        p.say(line)
    e = chosen.extract_devices
    kw = {k: o[k] for k in ("epochs", "seed", "window", "window_bytes", "keep_shards", "allow_slow_kernels")}
    kw.update(
        target_tok_s=o["target_tok_s"] or ex["tok_s"],
        hidden_size=o["hidden_size"],
        train_args=o["train_args"],
        manifest=o["manifest"],
        tp=tp,
        **{k: o[k] for k in MULTINODE if k in o},
    )
    if dev.kind == "cpu":
        return cpu_node_layout(o["config"], o["data"], workdir, extract_cpus=e, train_cpus=n - e, **kw)
    return node_layout(
        o["config"],
        o["data"],
        workdir,
        extract_gpus=",".join(dev.ids[:e]),
        train_gpus=",".join(dev.ids[e:]),
        **kw,
    )
