"""What the launchers start, their command line, and the disk arithmetic of a node layout.

:func:`pipeline_layout` (``bin/pipeline``) and :func:`node_layout` (``bin/node``) turn the
launcher's options into a :class:`Layout`: the plan command (``None`` when the work directory
already holds this plan), the extract and train processes with their environments, and notes to
print. :mod:`dflash_staged.launch` runs a layout.

Node layout: GPU ids are indices into the launcher's ``CUDA_VISIBLE_DEVICES`` when that is set,
else the ids ``nvidia-smi`` shows. Extract sees only its GPUs (``CUDA_VISIBLE_DEVICES``) and runs
one worker per GPU (``--devices cuda:0,...,cuda:n-1``); train sees only its GPUs and runs
under torchrun (``python -m torch.distributed.run --standalone --nproc-per-node G``) when
G > 1, with ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` raised so a clean stop has time to checkpoint.

Disk arithmetic (:func:`disk_requirements`): a token costs ``K x H x itemsize`` bytes of tapped
hidden states plus 5 bytes (int32 id + uint8 loss mask). Every byte is written once by extract
and read once by train, so the store must sustain ``2 x tok/s x extract GPUs x bytes/token``.
The disk a window needs is ``window shards x real tokens per job x bytes/token``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click

from .cli import user_errors
from .errors import DflashError
from .launch import PY, Proc

# Hidden sizes of the recipe targets, for the disk arithmetic when the model is not on local disk.
KNOWN_HIDDEN = {"Qwen/Qwen3-8B": 4096, "Qwen/Qwen3.5-27B": 5120}
# Assumed extract throughput per target GPU (real tokens/s) of an 8B dense target in bf16 on an
# H100-class GPU, prefill only and stopped after the deepest tapped layer. Measure yours with
# bench/gpu_smoke.sh or read extract's own tok/s line, and pass --target-tok-s.
DEFAULT_TARGET_TOK_S = 8000
SHUTDOWN_TIMEOUT_S = 600  # torchrun's grace for a clean stop (its default of 30 s is too short to checkpoint)


@dataclass
class Layout:
    workdir: Path
    plan_cmd: list[str] | None
    extract: Proc
    train: Proc
    disk_notes: Callable[[], list[str]] | None = None  # printed after planning (node: bandwidth, window disk)

    @property
    def manifest(self) -> Path:
        return self.workdir / "manifest"

    @property
    def store(self) -> Path:
        return self.workdir / "store"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"


def dflash_cmd(*args: str) -> list[str]:
    return [PY, "-m", "dflash_staged", *map(str, args)]


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def plan_cmd_if_needed(config: Path, data: Path, manifest: Path, epochs: int, seed: int) -> list[str] | None:
    """The `dflash plan` command, or None when `manifest` already holds a plan of this config,
    epochs and seed. A plan of anything else is an error naming the differences (extract and
    train read the config from the manifest, so an edited config would be silently ignored)."""
    cmd = dflash_cmd("plan", "--config", config, "--data", data, "--manifest", manifest, "--epochs", str(epochs),
                     "--seed", str(seed))
    if not (manifest / "manifest.db").is_file():
        return cmd
    from .config import load_config
    from .manifest import Manifest
    cfg = load_config(config)
    with Manifest.open(manifest, readonly=True) as m:
        have = {"config": m.config.to_dict(), "epochs": m.meta["epochs"], "seed": m.meta["seed"]}
    diffs = _diff(have, {"config": cfg.to_dict(), "epochs": epochs, "seed": seed})
    if diffs:
        raise DflashError(f"{manifest} was planned from other settings ({'; '.join(diffs[:6])}"
                          f"{'; ...' if len(diffs) > 6 else ''}); use another --workdir, or delete {manifest} "
                          f"(and {manifest.parent / 'store'}, {manifest.parent / 'run'}) to re-plan")
    return None


def _extract_args(manifest: Path, store: Path, devices: str, window, window_bytes, allow_slow: bool,
                  train_ranks: int = 1) -> list[str]:
    args = dflash_cmd("extract", "--manifest", manifest, "--store", store, "--devices", devices)
    if train_ranks > 1:
        args += ["--train-ranks", str(train_ranks)]
    if window is not None:
        args += ["--window", str(window)]
    if window_bytes:
        args += ["--window-bytes", str(window_bytes)]
    if allow_slow:
        args.append("--allow-slow-kernels")
    return args


def _train_args(manifest: Path, store: Path, run: Path, keep_shards: bool, extra: tuple[str, ...]) -> list[str]:
    args = ["train", "--manifest", str(manifest), "--store", str(store), "--out", str(run)]
    return args + (["--keep-shards"] if keep_shards else []) + list(extra)


BASE_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def pipeline_layout(config: Path, data: Path, workdir: Path, *, devices: str = "cpu", epochs: int = 1,
                    seed: int = 0, window=None, window_bytes=None, keep_shards: bool = False,
                    allow_slow_kernels: bool = False, train_args: tuple[str, ...] = ()) -> Layout:
    """Plan if needed, then extract on `devices` and train (on CPU when every extract device is)."""
    workdir = Path(workdir)
    m, s, r = workdir / "manifest", workdir / "store", workdir / "run"
    extra = tuple(train_args)
    env_ex, env_tr = dict(BASE_ENV), dict(BASE_ENV)
    cpu_devs = [d for d in devices.split(",") if d.strip() == "cpu"]
    if len(cpu_devs) == len(devices.split(",")):
        if "--device" not in extra:
            extra += ("--device", "cpu")
        # Share the cores: half to the extract workers, half to the trainer (oversubscribed threads
        # slowed generation 6x on a busy 2-core machine).
        half = max(1, (os.cpu_count() or 2) // 2)
        env_ex["OMP_NUM_THREADS"] = str(max(1, half // len(cpu_devs)))
        env_tr["OMP_NUM_THREADS"] = str(half)
    return Layout(workdir, plan_cmd_if_needed(Path(config), Path(data), m, epochs, seed),
                  Proc("extract", _extract_args(m, s, devices, window, window_bytes, allow_slow_kernels), env_ex),
                  Proc("train", [PY, "-m", "dflash_staged", *_train_args(m, s, r, keep_shards, extra)], env_tr))


def parse_gpus(text: str, flag: str) -> list[str]:
    """'0,1,2,3' -> physical ids, mapped through the launcher's CUDA_VISIBLE_DEVICES when set."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items) or len(set(items)) != len(items):
        raise DflashError(f"{flag} {text!r}: give distinct GPU indices separated by commas, e.g. 0,1,2,3")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return items
    bad = [t for t in items if int(t) >= len(visible)]
    if bad:
        raise DflashError(f"{flag} {text!r}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows only {len(visible)} "
                          f"GPU(s) (indices 0..{len(visible) - 1}); GPU ids are indices into it")
    return [visible[int(t)] for t in items]


def node_layout(config: Path, data: Path, workdir: Path, *, extract_gpus: str, train_gpus: str, epochs: int = 1,
                seed: int = 0, window=None, window_bytes=None, keep_shards: bool = False,
                allow_slow_kernels: bool = False, target_tok_s: float = DEFAULT_TARGET_TOK_S,
                hidden_size: int | None = None, train_args: tuple[str, ...] = ()) -> Layout:
    """One node: extract workers on `extract_gpus`, torchrun trainer ranks on `train_gpus`."""
    ex, tr = parse_gpus(extract_gpus, "--extract-gpus"), parse_gpus(train_gpus, "--train-gpus")
    both = sorted(set(ex) & set(tr), key=int)
    if both:
        raise DflashError(f"GPU(s) {','.join(both)} are in both --extract-gpus and --train-gpus; give each stage "
                          "its own GPUs (use bin/pipeline to share one)")
    workdir = Path(workdir)
    m, s, r = workdir / "manifest", workdir / "store", workdir / "run"
    devices = ",".join(f"cuda:{i}" for i in range(len(ex)))
    g = len(tr)
    train = _train_args(m, s, r, keep_shards, tuple(train_args))
    if g > 1:
        train_cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={g}", "-m",
                     "dflash_staged", *train]
    else:
        train_cmd = [PY, "-m", "dflash_staged", *train]
    layout = Layout(workdir, plan_cmd_if_needed(Path(config), Path(data), m, epochs, seed),
                    Proc("extract", _extract_args(m, s, devices, window, window_bytes, allow_slow_kernels, g),
                         {**BASE_ENV, "CUDA_VISIBLE_DEVICES": ",".join(ex)}),
                    Proc("train", train_cmd, {**BASE_ENV, "CUDA_VISIBLE_DEVICES": ",".join(tr),
                                              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S)}))
    layout.disk_notes = lambda: disk_requirements(config, len(ex), target_tok_s, hidden_size, m, window)[1]
    return layout


# ---------------------------------------------------------------------------------------------- disk arithmetic
def bytes_per_token(k: int, hidden: int, itemsize: int = 2) -> int:
    """Store bytes per real token: K tapped states of `hidden` values, + int32 id + uint8 loss mask."""
    return k * hidden * itemsize + 5


def target_hidden_size(model: str, override: int | None = None) -> int | None:
    """The target's hidden size without downloading: override, tiny config, local or cached
    config.json, or the recipe table; None when unknown."""
    if override:
        return override
    if model.startswith("tiny:"):
        from .tiny import tiny_config
        return tiny_config(model.split(":", 1)[1]).hidden_size
    paths = [Path(model) / "config.json"]
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(model, "config.json")
        if isinstance(cached, str):
            paths.append(Path(cached))
    except Exception:  # noqa: BLE001 - not a repo id, or no hub client: fall through
        pass
    for p in paths:
        try:
            c = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        c = c.get("text_config") or c
        if isinstance(c.get("hidden_size"), int):
            return c["hidden_size"]
    return KNOWN_HIDDEN.get(model)


def _si(n: float) -> str:
    """Decimal units, as disk vendors quote bandwidth: 2.62 GB, 310 MB."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def disk_requirements(config: Path, n_gpus: int, tok_s_per_gpu: float, hidden_override: int | None,
                      manifest: Path | None, window: int | None, itemsize: int | None = None) -> tuple[dict, list[str]]:
    """Bytes/token, write + read bandwidth and window disk of a node layout: (numbers, printable lines).
    `itemsize` defaults to the target dtype on CUDA (auto = bfloat16: 2 bytes)."""
    from .config import load_config
    cfg = load_config(config)
    itemsize = itemsize or {"float32": 4}.get(cfg.target.dtype, 2)
    layer_ids, avg_tokens, exact = None, float(cfg.data.token_budget), False
    if manifest is not None and (Path(manifest) / "manifest.db").is_file():
        from .manifest import Manifest
        with Manifest.open(manifest, readonly=True) as m:
            layer_ids = m.meta.get("layer_ids")
            avg_tokens = m.meta["tokens_real"] / max(1, m.meta["n_batches"])
            exact = True
    k = len(layer_ids or cfg.target.target_layer_ids) or cfg.drafter.num_hidden_layers
    hidden = target_hidden_size(cfg.target.model, hidden_override)
    window = window if window is not None else cfg.extract.window
    d = {"k": k, "hidden": hidden, "itemsize": itemsize, "extract_gpus": n_gpus, "tok_s_per_gpu": tok_s_per_gpu,
         "window": window, "avg_tokens_per_job": avg_tokens, "avg_exact": exact}
    if hidden is None:
        return d, [f"disk: hidden size of {cfg.target.model!r} unknown offline; pass --hidden-size H for the "
                   "bandwidth and window arithmetic"]
    bpt = bytes_per_token(k, hidden, itemsize)
    write = tok_s_per_gpu * n_gpus * bpt
    win = window * avg_tokens * bpt
    d.update(bytes_per_token=bpt, write_Bps=write, store_Bps=2 * write, window_bytes=win)
    lines = [
        f"bytes per token: K={k} tapped layers x hidden {hidden} x {itemsize} B + 5 B (id, loss mask) = {bpt:,} B",
        f"disk bandwidth: {tok_s_per_gpu:,.0f} tok/s per GPU (--target-tok-s) x {n_gpus} extract GPU(s) x {bpt:,} B "
        f"= {_si(write)}/s written; each byte is read once by train, so the store must sustain "
        f"{_si(2 * write)}/s (write + read)",
        f"window disk: {window} shards x {avg_tokens:,.0f} real tokens per job "
        f"({'plan average' if exact else 'upper bound: data.token_budget; exact after planning'}) x {bpt:,} B "
        f"= {_si(win)} (extract.window_bytes / --window-bytes caps it)",
    ]
    return d, lines


# ---------------------------------------------------------------------------------------------- command line
def _common(fn):
    opts = [
        click.option("--config", "config", required=True, type=click.Path(path_type=Path),
                     help="Config TOML (planned into WORKDIR/manifest unless that holds this plan already)."),
        click.option("--data", "data", required=True, type=click.Path(path_type=Path), help="JSONL data to plan."),
        click.option("--workdir", required=True, type=click.Path(path_type=Path),
                     help="Holds manifest/, store/ (shards; put it on NVMe) and run/ (checkpoints, metrics)."),
        click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
        click.option("--window", type=click.IntRange(min=1), default=None,
                     help="Shards claimed/written/consumed but not released [default: extract.window]."),
        click.option("--window-bytes", default=None, help="Byte cap of the window, e.g. 200G."),
        click.option("--keep-shards", is_flag=True, help="Keep consumed shards for later `train --replay`."),
        click.option("--allow-slow-kernels", is_flag=True, help="Hybrid target on CUDA without fla/causal-conv1d."),
        click.option("--status-every", type=float, default=10.0, show_default=True,
                     help="Seconds between combined status lines."),
        click.option("--summary-json", type=click.Path(path_type=Path), default=None,
                     help="Also write the final summary as JSON here."),
        click.option("--dry-run", is_flag=True, help="Print the processes it would start (commands + env); start none."),
        click.argument("train_args", nargs=-1, type=click.UNPROCESSED),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _run_layout(layout, status_every: float, summary_json: Path | None, dry_run: bool) -> int:
    if dry_run:
        if layout.plan_cmd is None:
            print(f"[dry-run] plan: skipped ({layout.manifest} already holds this plan)", flush=True)
        for line in (layout.disk_notes() if layout.disk_notes else []):
            print(f"[dry-run] {line}", flush=True)
    after = None
    if layout.disk_notes and not dry_run:
        def after():
            try:
                lines = layout.disk_notes()
            except Exception as e:  # noqa: BLE001 - the arithmetic is advice; never block the run on it
                lines = [f"disk arithmetic unavailable: {type(e).__name__}: {e}"]
            for line in lines:
                click.echo(f"[launch] {line}")
    if not dry_run and layout.plan_cmd is None:
        click.echo(f"[launch] {layout.manifest} already holds this plan; not re-planning")
    from .launch import run_side_by_side
    return run_side_by_side(layout.plan_cmd, layout.extract.cmd, layout.train.cmd, layout.extract.env,
                            layout.train.env, manifest=layout.manifest, store=layout.store, run_dir=layout.run_dir,
                            status_every=status_every, summary_path=summary_json, after_plan=after, dry_run=dry_run)


_CTX = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Plan, then run extract and train side by side: `pipeline` (any machine) or `node` (one GPU node).

    Arguments after the options (e.g. `-- --max-steps 100 --set train.lr=1e-3`) go to `dflash train`.
    """


@main.command(context_settings=_CTX)
@_common
@click.option("--devices", default="cpu", show_default=True, help="Extract workers: cpu, cpu,cpu or cuda:0,...")
@user_errors
def pipeline(config, data, workdir, epochs, seed, window, window_bytes, keep_shards, allow_slow_kernels,
             status_every, summary_json, dry_run, train_args, devices):
    """Plan if needed, then extract on --devices and train, side by side."""
    layout = pipeline_layout(config, data, workdir, devices=devices, epochs=epochs, seed=seed, window=window,
                             window_bytes=window_bytes, keep_shards=keep_shards,
                             allow_slow_kernels=allow_slow_kernels, train_args=train_args)
    sys.exit(_run_layout(layout, status_every, summary_json, dry_run))


@main.command(context_settings=_CTX)
@_common
@click.option("--extract-gpus", required=True, help="GPUs running the target, one extract worker each: 0,1,2,3.")
@click.option("--train-gpus", required=True, help="GPUs training the drafter (torchrun ranks): 4,5,6,7.")
@click.option("--target-tok-s", type=float, default=None,
              help="Assumed extract tokens/s per target GPU, for the disk bandwidth it prints [default: 8000, "
                   "an 8B dense target in bf16 on an H100-class GPU].")
@click.option("--hidden-size", type=int, default=None, help="Target hidden size, when it cannot be read offline.")
@user_errors
def node(config, data, workdir, epochs, seed, window, window_bytes, keep_shards, allow_slow_kernels,
         status_every, summary_json, dry_run, train_args, extract_gpus, train_gpus, target_tok_s, hidden_size):
    """One GPU node: extract on --extract-gpus, train under torchrun on --train-gpus, side by side."""
    layout = node_layout(config, data, workdir, extract_gpus=extract_gpus, train_gpus=train_gpus, epochs=epochs,
                         seed=seed, window=window, window_bytes=window_bytes, keep_shards=keep_shards,
                         allow_slow_kernels=allow_slow_kernels,
                         target_tok_s=target_tok_s or DEFAULT_TARGET_TOK_S, hidden_size=hidden_size,
                         train_args=train_args)
    sys.exit(_run_layout(layout, status_every, summary_json, dry_run))
