"""What the launchers start: the processes of ``dflash pipeline`` and ``dflash node``.

:func:`pipeline_layout` (``dflash pipeline``) and :func:`node_layout` (``dflash node``) turn the
launcher's options into a :class:`Layout`: the plan command (``None`` when the work directory
already holds this plan), the extract and train processes with their environments, and notes to
print. :func:`dflash_staged.launch.supervise.run_side_by_side` runs a layout.

Pipeline layout: extract runs on ``--devices``; train runs on the CPU when every extract device is
a CPU, else on the first CUDA device of the list (``--devices cuda:1`` trains on ``cuda:1``), unless
the train arguments name a ``--device``.

Node layout: GPU ids are indices into the launcher's ``CUDA_VISIBLE_DEVICES`` when that is set,
else the ids ``nvidia-smi`` shows; a list may use ranges (``0-3,6,7``). Extract sees only its GPUs
(``CUDA_VISIBLE_DEVICES``) and runs one worker per GPU (``--devices cuda:0,...,cuda:n-1``), or with
``--tp N`` one tensor-parallel worker per N consecutive GPUs; train sees only its GPUs and runs
as G torchrun ranks (``dflash train --nproc G``) when G > 1, with ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
raised so a clean stop has time to checkpoint.

CPU node layout (``dflash node --split auto --devices cpu,cpu,...``: how CI runs the node launcher):
each ``cpu`` device is a 1/n share of the cores (``OMP_NUM_THREADS``); extract runs one worker per
extract device (``--devices cpu,...``), train ``--device cpu`` as ``--nproc G`` ranks (gloo) when G > 1.

Both layouts give their children ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless the launcher's
environment sets it), so CUDA numbers the GPUs as ``nvidia-smi`` does (its own default puts the
fastest first). The disk arithmetic printed for a node layout is :mod:`dflash_staged.launch.disk`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.launch.disk import disk_requirements
from dflash_staged.launch.elastic import AGENT_ENV, is_elastic, torchrun_args
from dflash_staged.launch.multinode import check_multinode, wait_for_manifest
from dflash_staged.launch.supervise import PY, Proc

# Assumed extract throughput per extract worker (real tokens/s) of an 8B dense target in bf16 on one
# H100-class GPU, prefill only and stopped after the deepest tapped layer. Measure yours with
# bench/gpu_smoke.sh or read extract's own tok/s line, and pass --target-tok-s (with --tp N: the rate
# of one group of N GPUs).
DEFAULT_TARGET_TOK_S = 8000
SHUTDOWN_TIMEOUT_S = 600  # torchrun's grace for a clean stop (its default of 30 s is too short to checkpoint)


@dataclass
class Layout:
    workdir: Path
    plan_cmd: list[str] | None
    extract: Proc
    train: Proc
    disk_notes: Callable[[], list[str]] | None = None  # printed after planning (node: bandwidth, window disk)
    manifest_address: str | None = None  # --manifest (e.g. postgresql://...); default WORKDIR/manifest

    @property
    def manifest(self) -> Path | str:
        return self.manifest_address or self.workdir / "manifest"

    @property
    def store(self) -> Path:
        return self.workdir / "store"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"


def dflash_cmd(*args: str) -> list[str]:
    return [PY, "-m", "dflash_staged", *map(str, args)]


def plan_cmd_if_needed(
    config: Path, data: Path, manifest: Path | str, epochs: int, seed: int
) -> list[str] | None:
    """The `dflash plan` command, or None when `manifest` already holds this plan (the same config,
    data, epochs and seed: the manifest's own check). A plan of anything else is an error naming
    the differences (extract and train read the plan from the manifest, so an edited config or new
    data would be silently ignored)."""
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import load_config
    from dflash_staged.manifest import Manifest, ManifestMismatchError, plan_identity
    from dflash_staged.plan.dataset import data_hash

    cmd = dflash_cmd(
        "plan",
        "--config",
        config,
        "--data",
        data,
        "--manifest",
        manifest,
        "--epochs",
        str(epochs),
        "--seed",
        str(seed),
    )
    if not Manifest.exists(manifest):
        return cmd
    cfg = load_config(config)
    wanted = plan_identity(
        cfg.to_dict(), data_hash(data, ChatOptions.from_config(cfg.data).template), epochs, seed
    )
    with Manifest.open(manifest, readonly=True) as m:
        try:
            m.check_same_plan(wanted)
        except ManifestMismatchError as e:
            raise DflashError(
                f"{e}; or use another --workdir (and manifest; delete the old store and run "
                "directories with it)"
            ) from None
    return None


def _extract_args(
    manifest: Path,
    store: Path,
    devices: str,
    window,
    window_bytes,
    allow_slow: bool,
    train_ranks: int = 1,
    tp: int = 1,
) -> list[str]:
    args = dflash_cmd(
        "extract", "--manifest", manifest, "--store", store, "--devices", devices, "--trainer-coming"
    )  # started beside it: extract waits for it to register
    if tp > 1:
        args += ["--tp", str(tp)]
    if train_ranks > 1:
        args += ["--train-ranks", str(train_ranks)]
    if window is not None:
        args += ["--window", str(window)]
    if window_bytes is not None:  # 0 = no limit, over the config's
        args += ["--window-bytes", str(window_bytes)]
    if allow_slow:
        args.append("--allow-slow-kernels")
    return args


def _train_args(
    manifest: Path, store: Path, run: Path, keep_shards: bool, extra: tuple[str, ...]
) -> list[str]:
    args = ["train", "--manifest", str(manifest), "--store", str(store), "--out", str(run)]
    return args + (["--keep-shards"] if keep_shards else []) + list(extra)


BASE_ENV = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def base_env() -> dict[str, str]:
    """:data:`BASE_ENV` and the GPU numbering of ``nvidia-smi`` (the module docstring)."""
    return {**BASE_ENV, "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER") or "PCI_BUS_ID"}


def _names_device(train_args) -> bool:
    """Whether the train arguments choose the trainer's ``--device`` themselves."""
    return any(a == "--device" or a.startswith("--device=") for a in train_args)


def _device_arg(train_args) -> str:
    """The trainer's ``--device`` among its arguments (``cpu`` when none is given)."""
    args = list(train_args)
    for i, a in enumerate(args):
        if a.startswith("--device="):
            return a.split("=", 1)[1]
        if a == "--device" and i + 1 < len(args):
            return args[i + 1]
    return "cpu"


def train_device(devices: str) -> str:
    """The pipeline trainer's ``--device`` for extract ``devices``: ``cpu`` when every one is a CPU,
    else the first CUDA device (``cuda:1,cuda:2`` -> ``cuda:1``)."""
    devs = [d.strip() for d in devices.split(",") if d.strip()]
    return next((d for d in devs if d.startswith("cuda")), "cpu")


def pipeline_layout(
    config: Path,
    data: Path,
    workdir: Path,
    *,
    devices: str = "cpu",
    epochs: int = 1,
    seed: int = 0,
    window=None,
    window_bytes=None,
    keep_shards: bool = False,
    allow_slow_kernels: bool = False,
    train_args: tuple[str, ...] = (),
    manifest: str | None = None,
    tp: int = 1,
) -> Layout:
    """Plan if needed, then extract on `devices` (groups of `tp`) and train (on CPU when every extract
    device is, else on the first CUDA one: :func:`train_device`)."""
    workdir = Path(workdir)
    m, s, r = manifest or workdir / "manifest", workdir / "store", workdir / "run"
    extra = tuple(train_args)
    env_ex, env_tr = base_env(), base_env()
    if not _names_device(extra):
        extra += ("--device", train_device(devices))
    train_on = _device_arg(extra)
    if train_on.startswith("cuda") and train_on in {d.strip() for d in devices.split(",")}:
        env_tr["DFLASH_TRAIN_SHARES_GPU_WITH_EXTRACT"] = "1"  # its row budget leaves the target's memory
    cpu_devs = [d for d in devices.split(",") if d.strip() == "cpu"]
    if len(cpu_devs) == len(devices.split(",")):
        # Share the cores: half to the extract workers, half to the trainer (oversubscribed threads
        # slowed generation 6x on a busy 2-core machine).
        half = max(1, (os.cpu_count() or 2) // 2)
        env_ex["OMP_NUM_THREADS"] = str(max(1, half // len(cpu_devs)))
        env_tr["OMP_NUM_THREADS"] = str(half)
    return Layout(
        workdir,
        plan_cmd_if_needed(Path(config), Path(data), m, epochs, seed),
        Proc(
            "extract", _extract_args(m, s, devices, window, window_bytes, allow_slow_kernels, tp=tp), env_ex
        ),
        Proc("train", [PY, "-m", "dflash_staged", *_train_args(m, s, r, keep_shards, extra)], env_tr),
        manifest_address=manifest,
    )


def gpu_indices(text: str) -> list[str] | None:
    """'0,1,2,3' or '0-3' or '0-1,4,6-7' -> the indices in order; None when malformed."""
    out: list[str] = []
    for part in (t.strip() for t in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not (lo.isdigit() and (not dash or hi.isdigit())) or (dash and int(hi) < int(lo)):
            return None
        out += [str(i) for i in range(int(lo), int(hi if dash else lo) + 1)]
    return out


def parse_gpus(text: str, flag: str) -> list[str]:
    """'0,1,2,3' (or '0-3') -> physical ids, mapped through the launcher's CUDA_VISIBLE_DEVICES when set."""
    items = gpu_indices(text)
    if not items or len(set(items)) != len(items):
        raise DflashError(
            f"{flag} {text!r}: give distinct GPU indices separated by commas or as ranges, "
            "e.g. 0,1,2,3 or 0-3"
        )
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return items
    bad = [t for t in items if int(t) >= len(visible)]
    if bad:
        raise DflashError(
            f"{flag} {text!r}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows only {len(visible)} "
            f"GPU(s) (indices 0..{len(visible) - 1}); GPU ids are indices into it"
        )
    return [visible[int(t)] for t in items]


@dataclass(frozen=True)
class NodeOptions:
    """The options of a node layout besides its devices (the ``dflash node`` flags of the same names;
    ``target_tok_s`` and ``hidden_size`` only feed the disk arithmetic)."""

    epochs: int = 1
    seed: int = 0
    window: int | None = None
    window_bytes: int | None = None
    keep_shards: bool = False
    allow_slow_kernels: bool = False
    target_tok_s: float = DEFAULT_TARGET_TOK_S
    hidden_size: int | None = None
    train_args: tuple[str, ...] = ()
    manifest: str | None = None
    tp: int = 1
    # one node of several (``dflash node --nnodes``): the trainer is this node's share of one torchrun job
    nnodes: int = 1  # the most nodes (an elastic job's MAX)
    nnodes_min: int = 0  # an elastic job's MIN (0: nnodes, not elastic unless max_restarts)
    max_restarts: int = 0
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    node_local: bool = False  # a store per node (dflash_staged.manifest.layout)


def node_layout(
    config: Path, data: Path, workdir: Path, *, extract_gpus: str, train_gpus: str, **options
) -> Layout:
    """One node: extract workers on `extract_gpus` (groups of `tp`), torchrun trainer ranks on
    `train_gpus`; ``options``: :class:`NodeOptions`."""
    o = NodeOptions(**options)
    ex, tr = parse_gpus(extract_gpus, "--extract-gpus"), parse_gpus(train_gpus, "--train-gpus")
    if len(ex) % o.tp:
        raise DflashError(
            f"--tp {o.tp} does not divide the {len(ex)} GPU(s) of --extract-gpus {extract_gpus}: give "
            f"a multiple of {o.tp} extract GPUs (each tensor-parallel worker takes {o.tp})"
        )
    both = sorted(set(ex) & set(tr), key=int)
    if both:
        raise DflashError(
            f"GPU(s) {','.join(both)} are in both --extract-gpus and --train-gpus; give each stage "
            "its own GPUs (use bin/pipeline to share one)"
        )
    env_tr = {"CUDA_VISIBLE_DEVICES": ",".join(tr), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT_S)}
    return _node(
        config,
        data,
        workdir,
        o,
        extract_devices=",".join(f"cuda:{i}" for i in range(len(ex))),
        train_ranks=len(tr),
        env_ex={**base_env(), "CUDA_VISIBLE_DEVICES": ",".join(ex)},
        env_tr={**base_env(), **env_tr},
        train_extra=(),
    )


def _node(
    config: Path,
    data: Path,
    workdir: Path,
    o: NodeOptions,
    *,
    extract_devices: str,
    train_ranks: int,
    env_ex: dict[str, str],
    env_tr: dict[str, str],
    train_extra: tuple[str, ...],
) -> Layout:
    """A node's layout: plan if needed, extract on ``extract_devices``, train as ``train_ranks``
    torchrun ranks, and the disk arithmetic."""
    check_multinode(o)
    workdir = Path(workdir)
    m, s, r = o.manifest or workdir / "manifest", workdir / "store", workdir / "run"
    g = train_ranks
    local = ("--node-local",) if o.node_local else ()
    train = _train_args(m, s, r, o.keep_shards, tuple(o.train_args) + train_extra + local)
    nodes = (o.nnodes_min or o.nnodes, o.nnodes)
    if is_elastic(nodes, o.max_restarts):  # re-forms when nodes leave or come (launch.elastic)
        endpoint = f"{o.master_addr}:{o.master_port}"
        rdzv = torchrun_args(nodes, g, o.max_restarts, endpoint, o.manifest)
        train_cmd = [PY, "-m", "torch.distributed.run", *rdzv, "-m", "dflash_staged", *train]
        env_tr = {**env_tr, **AGENT_ENV}
    elif o.nnodes > 1:  # this node's share of one torchrun job spanning the nodes
        rdzv = [
            "--nnodes",
            str(o.nnodes),
            "--node-rank",
            str(o.node_rank),
            "--master-addr",
            str(o.master_addr),
        ]
        rdzv += ["--master-port", str(o.master_port), "--nproc-per-node", str(g)]
        train_cmd = [PY, "-m", "torch.distributed.run", *rdzv, "-m", "dflash_staged", *train]
    else:
        train_cmd = [PY, "-m", "dflash_staged", *train] + (
            ["--nproc", str(g)] if g > 1 else []
        )  # torchrun ranks
    # the window rule counts the ranks its shards feed: this node's (node-local), or every node's
    fed = g if o.node_local else g * o.nnodes
    ex_args = _extract_args(m, s, extract_devices, o.window, o.window_bytes, o.allow_slow_kernels, fed, o.tp)
    ex_args += list(local)
    if o.node_rank > 0:  # node 0 plans; the others wait for its plan, then check it is theirs
        wait_for_manifest(m)
    layout = Layout(
        workdir,
        plan_cmd_if_needed(Path(config), Path(data), m, o.epochs, o.seed),
        Proc("extract", ex_args, env_ex),
        Proc("train", train_cmd, env_tr),
        manifest_address=o.manifest,
    )
    n_extract = len(extract_devices.split(","))
    layout.disk_notes = lambda: disk_requirements(
        config, n_extract, o.target_tok_s, o.hidden_size, m, o.window, tp=o.tp
    )[1]
    return layout


def cpu_threads(n_devices: int) -> int:
    """Threads of one ``cpu`` device of a CPU node: its share of the cores."""
    return max(1, (os.cpu_count() or 2) // max(1, n_devices))


def cpu_node_layout(
    config: Path, data: Path, workdir: Path, *, extract_cpus: int, train_cpus: int, **options
) -> Layout:
    """A node of ``extract_cpus + train_cpus`` CPU devices (the module docstring); ``options``:
    :class:`NodeOptions`."""
    o = NodeOptions(**options)
    device = () if _names_device(o.train_args) else ("--device", "cpu")
    env = {**base_env(), "OMP_NUM_THREADS": str(cpu_threads(extract_cpus + train_cpus))}
    return _node(
        config,
        data,
        workdir,
        o,
        extract_devices=",".join(["cpu"] * extract_cpus),
        train_ranks=train_cpus,
        env_ex=env,
        env_tr=dict(env),
        train_extra=device,
    )
