"""The GPU smoke check's steps (``bench/gpu_smoke.py`` runs each in a child process, in this order of
value, and owns the budget, the verdicts and the outputs).

Each step is ``fn(work, dev, seconds) -> dict`` with ``status``: ``ok``, ``failed`` or ``skipped`` (and
``why`` when not ok), and its numbers; ``work`` is the step's scratch directory (never the folder that
comes back), ``seconds`` the time it may take. What each checks:

1. ``recipe_train``: training steps of a drafter at the Qwen3-8B recipe's shapes (random weights
   from a config, bf16 autocast; ``bench/recipe_step.py``), in every variant even when one fails:
   plain, activation checkpointing, the DFlash2 recipe's drafter, uneven sequence lengths (the
   padded row count is not a power of two), and a loss on the target's distribution (its logits
   recomputed from a stored last layer): tokens/s, ``max_memory_allocated`` against
   ``dflash_staged.train.memory``'s estimate for the largest microbatch each ran (ok within +20%),
   and the flex block mask's build time a step.
2. ``train_e2e``: plan a small synthetic dataset for ``tiny:qwen3`` in bf16, then ``dflash extract
   --devices cuda:0`` and ``dflash train --device cuda`` side by side through the launcher
   (``python -m dflash_staged pipeline``); the drafter trains under bf16 autocast on flex.
3. ``hybrid_extract``: the kernel preflight for a tiny hybrid target (``tiny:qwen3_5``, bf16), then a
   real ``dflash extract`` on it. When the preflight passes, extract must run on the fast kernels and
   write bf16 shards. When it refuses although flash-linear-attention is installed, the step fails.
   When it is not installed, the fast path is **skipped** (not passed): the step checks only that
   extract refuses, then runs with ``--allow-slow-kernels``. causal-conv1d is optional.
4. ``extract_throughput``: real tokens/s of the hooked, early-stopped ``Target.capture`` against a
   bare full forward of the same model and batch (a dense Qwen3 built in code, 24 layers, hidden
   2048, bf16, 8 x 2048 tokens). Goal on CUDA: ratio >= 0.9.
5. ``cuda_tests``: ``pytest -m cuda`` over the test files that hold CUDA-marked tests. A file whose
   module-level imports are not installed is left out and named, and fails the step; so does a run
   that collected nothing or skipped a CUDA test (on a CPU every CUDA test skips: the step is then
   reported skipped).
6. ``tp_extract`` (2+ GPUs; skipped, and not required, with one): ``dflash extract --tp 2`` on the
   tiny MoE target with one ``kill -9`` of the follower mid-run; every shard then compared with a
   one-GPU forward of the same batch.

``dev = "cpu"`` runs the same steps with small shapes (a check of the plumbing, CI's rehearsal).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NEEDED = (
    "torch",
    "transformers",
    "safetensors",
    "zarr",
    "numcodecs",
    "xxhash",
    "numpy",
    "click",
    "tqdm",
    "tokenizers",
    "pytest",
)


def env() -> dict:
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def sh(cmd: list, timeout: float, log: Path | None = None) -> tuple[int, str]:
    """Run cmd, its output streamed into this step's log (this process's stdout) as it comes and
    returned; rc 124 when it outlives ``timeout`` (its process group is killed, what it printed kept).
    ``log`` is accepted for older callers and ignored: the step's log is this process's output."""
    import signal
    import threading

    t0 = time.time()
    print(f"[gpu_smoke] $ {' '.join(map(str, cmd))}", flush=True)
    p = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        for line in p.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        rc = 124
        lines.append(f"\n[gpu_smoke] timed out after {timeout:.0f} s\n")
    reader.join(timeout=10)
    print(f"[gpu_smoke] -> rc {rc} ({time.time() - t0:.0f} s)", flush=True)
    return rc, "".join(lines)


def tail(text: str, n: int = 600) -> str:
    return text[-n:]


# ---------------------------------------------------------------------------------------------- data /
# configs
TINY_GPU_CONFIG = """
[target]
model = "{model}"
dtype = "auto"
[data]
max_len = 512
num_buckets = 3
token_budget = 2048
[drafter]
num_hidden_layers = 2
intermediate_size = 256
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 32
block_size = 8
mask_token_id = 3
dtype = "bfloat16"
[train]
lr = 2e-3
warmup_ratio = 0.1
grad_accum = 2
microbatch_tokens = 2048
num_anchors = 32
gamma = 4.0
buffer_capacity = 4
min_ready = 2
checkpoint_every = 4
log_every = 1
[extract]
window = 16
lease_s = 120
"""


def write_data(path: Path, n: int, seed: int = 0) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            L = int(rng.integers(48, 480))
            ids = rng.integers(4, 2048, L).tolist()
            p = int(rng.integers(4, L // 4))
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (L - p)}) + "\n")
    return path


def plan(work: Path, model: str, n: int) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "config.toml"
    cfg.write_text(TINY_GPU_CONFIG.format(model=model))
    data = write_data(work / "data.jsonl", n)
    rc, text = sh(
        [
            sys.executable,
            "-m",
            "dflash_staged",
            "plan",
            "--config",
            cfg,
            "--data",
            data,
            "--manifest",
            work / "manifest",
        ],
        180,
        work / "plan.log",
    )
    if rc != 0:
        raise RuntimeError(f"plan failed: {tail(text)}")
    return cfg


# ---------------------------------------------------------------------------------------------- steps
CUDA_MARK = re.compile(r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bmark\.cuda\b)", re.M)


def _missing_imports(path: Path) -> list[str]:
    """Top-level packages that ``path`` imports at module level (outside ``try``) and that are not
    installed; a test file with any of them would fail pytest's collection."""
    import ast

    missing = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for top in {n.split(".")[0] for n in names}:
            local = (path.parent / f"{top}.py").is_file() or (path.parent / top).is_dir()
            if not local and importlib.util.find_spec(top) is None:
                missing.add(top)
    return sorted(missing)


def cuda_test_files(tests: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """The test files that hold CUDA-marked tests, split into those pytest can collect here and the
    rest (file name -> the packages it imports that are missing, e.g. hypothesis or pyarrow)."""
    run, left_out = [], {}
    for f in sorted(tests.glob("test_*.py")):
        if not CUDA_MARK.search(f.read_text()):
            continue
        missing = _missing_imports(f)
        if missing:
            left_out[f.name] = missing
        else:
            run.append(f)
    return run, left_out


def step_cuda_tests(work: Path, dev: str, seconds: float) -> dict:
    """``pytest -m cuda`` over the files that hold CUDA tests, those whose imports are all installed.
    Failed: a file left out for a missing package (named), a failure, nothing collected, or a CUDA
    test skipped (named with its reason: it was meant to run). On a CPU every CUDA test skips: the
    run still checks collection, and the step is reported skipped."""
    files, left_out = cuda_test_files(ROOT / "tests")
    res: dict = {"files": [f.name for f in files]}
    problems = []
    if left_out:
        res["left_out"] = left_out
        pkgs = sorted({p for ps in left_out.values() for p in ps})
        problems.append(
            f"not run: {', '.join(left_out)} (hold CUDA tests but import {', '.join(pkgs)}, not installed;"
            " install them, docs/gpu.md lists the wheels)"
        )
    if not files:
        return dict(
            res, status="failed", why="; ".join(problems + ["no test file with CUDA tests under tests/"])
        )
    work.mkdir(parents=True, exist_ok=True)
    xml = work / "cuda_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider"]
    rc, text = sh(cmd + [f"--junitxml={xml}"] + [str(f.relative_to(ROOT)) for f in files], seconds)
    res["rc"] = rc
    skipped: list[str] = []
    if xml.is_file():
        suites = ET.parse(xml).getroot()
        suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] = int(suite.get(k, 0))
        cases = list(suite.iter("testcase"))
        res["failed_names"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in cases
            if c.find("failure") is not None or c.find("error") is not None
        ][:20]
        skipped = [
            f"{c.get('name')}: {(c.find('skipped').get('message') or '')[:120]}"
            for c in cases
            if c.find("skipped") is not None
        ]
        res["skipped_names"] = skipped[:20]
    if rc == 124:
        problems.append(f"timed out after {seconds:.0f} s")
    if not res.get("tests"):
        problems.append("no CUDA test was collected")
    if res.get("failures") or res.get("errors") or rc not in (0, 5, 124):
        problems.append(f"pytest failed (rc {rc}): {', '.join(res.get('failed_names') or [])}")
    if not dev.startswith("cuda"):
        if problems:
            return dict(res, status="failed", why="; ".join(problems))
        return dict(res, status="skipped", why=f"no GPU: the {res.get('tests', 0)} CUDA tests skip on a CPU")
    if skipped:
        problems.append(
            f"{len(skipped)} CUDA test(s) skipped that were meant to run: {'; '.join(skipped[:3])}"
        )
    if problems:
        return dict(res, status="failed", why="; ".join(problems), tail=tail(text))
    return dict(res, status="ok")


def kernels_installed() -> dict[str, bool]:
    """Whether each fast-kernel package of the hybrid targets is installed (importable or not)."""
    return {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}


def hybrid_verdict(dev: str, installed: dict[str, bool], refusal: str | None) -> tuple[str, str]:
    """What ``hybrid_extract`` checks, from the device, the installed kernels and the preflight's
    refusal (None when it passed): ``("fast", why)``: run extract on the fast kernels, it must write
    shards; ``("fail", why)``: the step fails at once; ``("slow", why)``: flash-linear-attention (the
    kernel the preflight requires) is not installed, so the fast path is skipped and only the refusal
    and ``--allow-slow-kernels`` are checked."""
    if not dev.startswith("cuda"):
        return "fast", "cpu: transformers' PyTorch reference path (the fast kernels need CUDA)"
    if refusal is None:
        return "fast", "the preflight passed: extract must run on the fast kernels"
    if installed.get("fla"):
        return "fail", f"flash-linear-attention (fla) is installed but the preflight refuses it: {refusal}"
    return "slow", (
        "flash-linear-attention is not installed, so the fast path was not checked (docs/gpu.md: offline "
        "GPU machines); checked only that extract refuses and runs with --allow-slow-kernels"
    )


def step_hybrid_extract(work: Path, dev: str, seconds: float) -> dict:
    from dflash_staged.model.target.preflight import KernelPreflightError, preflight_kernels
    from dflash_staged.model.target.tiny import tiny_config

    res: dict = {"kernels_installed": kernels_installed()}
    refusal = None
    try:
        preflight_kernels(tiny_config("qwen3_5"), dev, allow_slow=False)
        res["preflight"] = "passed"
    except KernelPreflightError as e:
        res["preflight"] = "refused"
        refusal = res["preflight_message"] = str(e)[:600]
    verdict, why = hybrid_verdict(dev, res["kernels_installed"], refusal)
    res["verdict"] = why
    if verdict == "fail":
        return dict(res, status="failed", why=why)
    w = work / "hybrid"
    plan(w, "tiny:qwen3_5", 24 if dev.startswith("cuda") else 8)
    cmd = [sys.executable, "-m", "dflash_staged", "extract", "--manifest", w / "manifest"]
    cmd += ["--store", w / "store", "--devices", dev, "--window", "64"]  # no trainer: room for all
    rc, text = sh(cmd, seconds / 2)
    res["extract_rc"] = rc
    if verdict == "fast":
        from dflash_staged.store import ShardStore

        ok = rc == 0
        if ok:
            st = ShardStore.open(w / "store")
            res["store_dtype"] = st.meta.logical_dtype
            res["shards"] = sum(1 for _ in st.iter_shards())
            want = "bfloat16" if dev.startswith("cuda") else "float32"  # dtype auto
            ok = st.meta.logical_dtype == want and res["shards"] > 0
        if ok:
            return dict(res, status="ok")
        return dict(
            res, status="failed", why=f"extract rc {rc}, store {res.get('store_dtype')}", tail=tail(text)
        )
    # the slow branch: the fast kernels were not checked, so the step is skipped, not passed
    res["refused_as_expected"] = rc != 0 and "fast kernels" in text
    rc2, text = sh(cmd + ["--allow-slow-kernels"], seconds / 2)
    res["allow_slow_rc"] = rc2
    if res["refused_as_expected"] and rc2 == 0:
        return dict(res, status="skipped", why=why)
    return dict(
        res, status="failed", why=f"{why}; and extract did not refuse, or failed with --allow-slow-kernels"
    )


def step_throughput(work: Path, dev: str, seconds: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_staged.config import dflash_target_layers
    from dflash_staged.model.target import Target, pack_unpadded

    gpu = dev.startswith("cuda")
    H, layers, B, L = (2048, 24, 8, 2048) if gpu else (256, 8, 2, 256)
    warmup, repeats = (3, 10) if gpu else (1, 3)
    cfg = Qwen3Config(
        vocab_size=32768,
        hidden_size=H,
        intermediate_size=3 * H,
        num_hidden_layers=layers,
        num_attention_heads=H // 128,
        num_key_value_heads=max(1, H // 256),
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dev = torch.device(dev)
    dtype = torch.bfloat16 if gpu else torch.float32
    with dev:  # initialise the random weights on the device itself (fast on a GPU)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    layer_ids = dflash_target_layers(cfg.num_hidden_layers, 5)
    target = Target(model, layer_ids, f"bench:dense-{layers}x{H}", dev)
    ids = torch.randint(4, cfg.vocab_size, (B, L), device=dev)
    mask = torch.ones_like(ids)
    lengths = torch.full((B,), L, dtype=torch.long)
    host = torch.empty(B * L, len(layer_ids), H, dtype=dtype, pin_memory=gpu)

    def capture():
        return pack_unpadded(target.capture(ids, mask), lengths)

    def capture_d2h():
        host.copy_(capture(), non_blocking=True)

    def full():
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def sync():
        if gpu:
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    fns = {"capture": capture, "capture_d2h": capture_d2h, "full": full}
    for fn in fns.values():
        for _ in range(warmup):
            timed(fn)
    times = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved, so drift hits all paths alike
        for k, fn in fns.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    tok = B * L
    res = {
        "model": f"qwen3 dense {layers} layers, hidden {H}, {str(dtype)[6:]}",
        "batch": f"{B}x{L}",
        "layer_ids": layer_ids,
        "capture_tok_s": round(tok / med["capture"]),
        "capture_d2h_tok_s": round(tok / med["capture_d2h"]),
        "full_forward_tok_s": round(tok / med["full"]),
        "ratio": round(med["full"] / med["capture"], 3),
        "ratio_with_d2h": round(med["full"] / med["capture_d2h"], 3),
        "repeats": repeats,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if gpu else None,
    }
    if gpu and res["ratio"] < 0.9:
        res.update(status="failed", why=f"capture / full forward = {res['ratio']}: the goal is >= 0.9")
    else:  # the goal is a GPU one: on a CPU the step checks the code
        res["status"] = "ok"
    model = target = None  # free the weights (the closures above hold them)
    if gpu:
        torch.cuda.empty_cache()
    return res


def step_train_e2e(work: Path, dev: str, seconds: float) -> dict:
    work = work / "e2e"
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "config.toml"
    cfg.write_text(TINY_GPU_CONFIG.format(model="tiny:qwen3"))
    data = write_data(work / "data.jsonl", 96 if dev.startswith("cuda") else 32, seed=1)
    summary = work / "summary.json"
    rc, text = sh(
        [
            sys.executable,
            "-m",
            "dflash_staged",
            "pipeline",
            "--config",
            cfg,
            "--data",
            data,
            "--workdir",
            work / "w",
            "--devices",
            dev,
            "--summary-json",
            summary,
            "--status-every",
            "5",
            "--",
            "--device",
            dev.split(":")[0],
        ],
        seconds,
    )
    res = {"rc": rc}
    if summary.is_file():
        s = json.loads(summary.read_text())
        res.update(
            {
                k: s.get(k)
                for k in (
                    "steps",
                    "loss_first",
                    "loss_last",
                    "total_jobs",
                    "tokens_trained",
                    "peak_store_bytes",
                    "extract_s",
                    "train_s",
                    "total_s",
                )
            }
        )
    ckpts = (
        sorted(p.name for p in (work / "w" / "run").glob("*") if p.is_dir())
        if (work / "w" / "run").is_dir()
        else []
    )
    res["run_dir_entries"] = ckpts[:6]
    loss = res.get("loss_last")
    if rc == 0 and (res.get("steps") or 0) >= 1 and loss is not None and math.isfinite(loss):
        return dict(res, status="ok")
    return dict(
        res,
        status="failed",
        why=f"the pipeline: rc {rc}, {res.get('steps')} step(s), loss {loss}",
        tail=tail(text, 1500),
    )


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of ``pid`` (the extract worker processes), from /proc."""
    kids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in cmd:
            kids.append(int(d.name))
    return kids


def step_tp_extract(work: Path, dev: str, seconds: float) -> dict:
    import signal

    import torch

    gpu = dev.startswith("cuda")
    if gpu and torch.cuda.device_count() < 2:
        return {"status": "skipped", "why": f"needs 2 GPUs; this machine shows {torch.cuda.device_count()}"}
    if importlib.util.find_spec("accelerate") is None:
        return {
            "status": "failed",
            "why": "accelerate is not installed: transformers' tensor-parallel loading (tp_plan) needs it; "
            "install it (pip install accelerate; docs/gpu.md lists the wheel)",
        }
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.target import load_target, pack_unpadded, pad_batch
    from dflash_staged.store import ShardStore

    devices = "cuda:0,cuda:1" if gpu else "cpu,cpu"
    work = work / "tp"
    plan(work, "tiny:qwen3_moe", 48)
    log = work / "extract.log"
    cmd = [
        sys.executable,
        "-m",
        "dflash_staged",
        "extract",
        "--manifest",
        work / "manifest",
        "--store",
        work / "store",
        "--devices",
        devices,
        "--tp",
        "2",
        "--window",
        "64",
    ]
    res: dict = {"devices": devices}
    with open(log, "w") as f:
        p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT)
        t0 = time.time()
        with Manifest.open(work / "manifest", readonly=True) as m:
            while p.poll() is None and "killed_follower" not in res and time.time() - t0 < seconds / 2:
                claimed = {j.pid for j in m.jobs("claimed") if j.pid}
                followers = sorted(set(_spawned_children(p.pid)) - claimed)
                if claimed and followers:
                    os.kill(followers[0], signal.SIGKILL)
                    res["killed_follower"] = followers[0]
                time.sleep(0.01)
        try:
            res["rc"] = p.wait(timeout=max(10.0, seconds - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            res["rc"] = 124
    text = log.read_text()
    res["restarted"] = "restarting it (1 of" in text
    with Manifest.open(work / "manifest", readonly=True) as m:
        jobs = m.jobs()
        res["jobs"], res["written"] = len(jobs), m.counts()["written"]
        if res["rc"] == 0:
            target = load_target(m.config.target, dev, layer_ids=m.meta["layer_ids"])
            store, worst = ShardStore.open(work / "store"), 0.0
            for j in jobs:
                shard = store.read_shard(j.epoch, j.id, j.checksum)
                ids, attn, lengths = pad_batch(
                    [torch.from_numpy(m.sample(s)[0].astype("int64")) for s in j.sample_ids]
                )
                ref = pack_unpadded(target.capture(ids, attn), lengths).float().cpu()
                worst = max(worst, (shard.hidden.float() - ref).abs().max().item())
            res["max_abs_diff_vs_tp1"], res["store_dtype"] = worst, store.meta.logical_dtype
    tol = 0.25 if gpu else 1e-5
    ok = (
        res["rc"] == 0
        and res["written"] == res["jobs"] > 0
        and "killed_follower" in res
        and res["restarted"]
        and res.get("max_abs_diff_vs_tp1", 1e9) <= tol
    )
    if ok:
        return dict(res, status="ok")
    print(text, flush=True)  # the extract's own log, into this step's
    return dict(
        res,
        status="failed",
        why="the TP group did not restart and finish every job exactly",
        tail=tail(text, 1500),
    )


# ---------------------------------------------------------------------------------------------- recipe
RECIPE_VARIANTS = (
    ("plain", []),
    ("checkpointing", ["--checkpointing"]),
    ("dflash2", ["--architecture", "dflash2"]),
    ("uneven", ["--uneven"]),  # sequence lengths that make the padded row count no power of two
    ("target_loss", ["--loss", "ce=0.1,tv=0.9"]),  # the target's logits too, from its stored last layer
)


def step_recipe_train(work: Path, dev: str, seconds: float) -> dict:
    """Training steps at the Qwen3-8B recipe's shapes (``bench/recipe_step.py``), every variant of
    :data:`RECIPE_VARIANTS` even when one fails: tokens/s, and CUDA's peak against the memory
    estimate for the largest microbatch each ran (ok when it does not exceed it by more than 20%).
    On CPU: small widths, a check of the plumbing."""
    gpu = dev.startswith("cuda")
    small = [] if gpu else ["--small", "--steps", "2", "--tokens", "512", "--seq-len", "64", "--rows", "1000"]
    res: dict = {}
    failed, t0 = [], time.time()
    for i, (name, extra) in enumerate(RECIPE_VARIANTS):
        share = (seconds - (time.time() - t0)) / (len(RECIPE_VARIANTS) - i)
        cmd = [sys.executable, ROOT / "bench" / "recipe_step.py", "--device", dev, *small, *extra]
        rc, text = sh(cmd, share)
        line = next((x for x in reversed(text.splitlines()) if x.startswith("{")), None)
        if rc != 0 or line is None:
            res[name] = {"status": "failed", "why": f"recipe_step.py: rc {rc}", "tail": tail(text, 800)}
            failed.append(name)
            continue
        r = json.loads(line)
        ratio = r["measured_over_estimate"]
        if ratio is not None and ratio > 1.2:
            r.update(status="failed", why=f"measured peak {ratio}x the estimate (over 1.2x)")
            failed.append(name)
        else:
            r["status"] = "ok"
        res[name] = r
    if failed:
        return dict(res, status="failed", why=f"variant(s) {', '.join(failed)} failed")
    return dict(res, status="ok")


STEPS = {
    "recipe_train": step_recipe_train,
    "train_e2e": step_train_e2e,
    "hybrid_extract": step_hybrid_extract,
    "extract_throughput": step_throughput,
    "cuda_tests": step_cuda_tests,
    "tp_extract": step_tp_extract,
}
