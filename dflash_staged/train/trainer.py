"""Everything around the training loop: options, distributed setup, the model and optimizer,
resume from a checkpoint, consumption bookkeeping, checkpoint + release, metrics.

:func:`build_run` returns a :class:`Run` that :func:`dflash_staged.train.train_loop` drives.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.buffer import ShardBuffer, bound_host_memory
from dflash_staged.train.distributed import Dist
from dflash_staged.train.progress import Progress
from dflash_staged.config import REPLAY_OVERRIDABLE, Config, apply_overrides
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.train.sources import LiveSource, ReplaySource

STORE_WAIT_POLL_S = 0.5


@dataclass
class TrainOptions:
    manifest: Path
    store: Path
    out: Path
    replay: bool = False
    keep_shards: bool = False
    order_from: Path | None = None
    passes: int = 1
    overrides: dict = field(default_factory=dict)  # {section: {key: value}}
    device: str | None = None
    verify: bool = True
    max_steps: int | None = None
    tensorboard: bool = False


def _gen_state(g: torch.Generator) -> str:
    return base64.b64encode(g.get_state().numpy().tobytes()).decode()


def _set_gen_state(g: torch.Generator, s: str) -> None:
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8))


def target_dims(target_cfg) -> tuple[int, int, int]:
    """(num_layers, hidden_size, vocab_size) of the target, from its config only."""
    if target_cfg.model.startswith("tiny:"):
        from dflash_staged.model.tiny import tiny_config
        c = tiny_config(target_cfg.model.split(":", 1)[1])
    else:
        from transformers import AutoConfig
        kw = {"gguf_file": target_cfg.gguf_file} if target_cfg.gguf_file else {}
        try:
            c = AutoConfig.from_pretrained(target_cfg.model, **kw)
        except (OSError, ValueError) as e:
            raise DflashError(f"cannot read the target config of {target_cfg.model!r}: {e}") from None
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    return c.num_hidden_layers, c.hidden_size, c.vocab_size


# ---------------------------------------------------------------------------------------------- the run
class Run:
    """The model, optimizer, data source and bookkeeping of one training run (one rank)."""

    def __init__(self, opts: TrainOptions, cfg: Config, dist: Dist, device: torch.device, m: Manifest, store,
                 drafter, source, buffer: ShardBuffer, total_steps: int):
        from dflash_staged.train.objective import dflash_loss
        self.opts, self.cfg, self.dist, self.device = opts, cfg, dist, device
        self.m, self.store, self.drafter, self.source, self.buffer = m, store, drafter, source, buffer
        self.total_steps = total_steps
        self.params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
        self.names = {p: n for n, p in self.params.items()}
        t = cfg.train
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=t.lr, betas=tuple(t.betas),
                                     weight_decay=t.weight_decay, eps=1e-8)
        self.draw_gen = torch.Generator().manual_seed(t.seed * 1_000_003 + 17 + dist.rank)
        self.anchor_gen = torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + 101 + dist.rank)
        self._dflash_loss = dflash_loss
        self.step = 0
        self.ckpt_step = 0
        self.consumed: dict[int, list] = {}
        self.metrics_path = opts.out / "metrics.jsonl"
        self.progress = Progress(total_steps, enabled=dist.rank == 0)
        self._tb = None

    # -- numerics --------------------------------------------------------------------------------
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def noise_std(self) -> float:
        from dflash_staged.train.objective import noise_std_at
        t = self.cfg.train
        return noise_std_at(self.step, self.total_steps, t.noise_std, t.noise_schedule)

    def loss_fn(self, mb: dict, noise: float):
        t = self.cfg.train
        return self._dflash_loss(self.drafter, mb, t.num_anchors, t.gamma, self.anchor_gen, noise, t.loss_chunk)

    def zero_stats(self) -> dict:
        B = self.drafter.block_size
        z = torch.zeros(B - 1, dtype=torch.float64, device=self.device)
        return {"correct": z.clone(), "total": z.clone(), "loss_sum": torch.zeros((), dtype=torch.float64,
                device=self.device), "weight_sum": torch.zeros((), dtype=torch.float64, device=self.device)}

    @staticmethod
    def add_stats(acc: dict, st: dict) -> None:
        for k in acc:
            acc[k] += st[k].detach().to(acc[k].dtype)

    def optimizer_step(self, lr: float) -> None:
        params = list(self.params.values())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.dist.all_reduce_([p.grad for p in params])
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    # -- bookkeeping -----------------------------------------------------------------------------
    def mark_consumed(self, jobs: list) -> None:
        """Record what step self.step consumed; live rank 0 marks the jobs consumed in the manifest."""
        self.consumed[self.step] = [list(j) for j in jobs]
        if isinstance(self.source, LiveSource) and self.dist.rank == 0:
            self.m.consume([j[0] for j in jobs], self.step, {j[0]: j[1] for j in jobs})

    def would_wait(self) -> bool:
        self.source.fill(self.buffer)
        return len(self.buffer) < self.cfg.train.min_ready and not self.source.finished()

    def holds_unreleased(self) -> bool:
        return isinstance(self.source, LiveSource) and self.step > self.ckpt_step

    def log_step(self, jobs: list, stats: dict, lr: float, wait_s: float, step_s: float, choices: int) -> None:
        from dflash_staged.train.objective import acceptance_metrics, per_offset_accuracy
        sync = self.device.type != "cuda" or self.step % self.cfg.train.log_every == 0
        loss = acc = tau = None
        if sync:
            vals = [stats["correct"], stats["total"], stats["loss_sum"].reshape(1), stats["weight_sum"].reshape(1)]
            self.dist.all_reduce_(vals)
            loss = float(stats["loss_sum"] / stats["weight_sum"].clamp_min(1e-12))
            acc, tau = acceptance_metrics(per_offset_accuracy(stats["correct"], stats["total"]))
        if self.dist.rank != 0:
            return
        tokens = sum(j[2] for j in jobs)
        line = {"step": self.step, "loss": loss, "lr": lr, "acc": acc, "tau": tau, "tokens": tokens,
                "jobs": [j[0] for j in jobs], "ranks": [j[1] for j in jobs], "buckets": [j[3] for j in jobs],
                "lengths": [round(j[4], 1) for j in jobs], "data_wait_s": round(wait_s, 4),
                "step_s": round(step_s, 4), "buffer": len(self.buffer), "bucket_choices": choices}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self._tb is not None and loss is not None:
            self._tb.add_scalar("loss", loss, self.step)
            self._tb.add_scalar("tau", tau, self.step)
            self._tb.add_scalar("lr", lr, self.step)
        self.progress.step(self.step, loss, tokens / max(step_s, 1e-9), len(self.buffer), self.buffer.capacity)

    def close(self) -> None:
        self.buffer.close()
        if not self.opts.replay and self.dist.rank == 0:
            self.store.cleanup_temp()  # leftovers of writers that died after the last extract exited
        if not self.opts.replay:
            for p in self.m.live_procs("train"):
                if p["pid"] == os.getpid():
                    self.m.unregister(p["id"])
        if self._tb is not None:
            self._tb.close()
        self.dist.close()

    # -- checkpoint + release ----------------------------------------------------------------------
    def checkpoint_and_release(self) -> None:
        """Save a checkpoint covering every completed step, then delete (or keep) the shards it covers."""
        if self.step == self.ckpt_step:
            return
        buffers = self.dist.gather_obj(self.buffer.job_ids())
        gens = self.dist.gather_obj({"draw": _gen_state(self.draw_gen), "anchor": _gen_state(self.anchor_gen)})
        if self.dist.rank == 0:
            tensors = {f"master.{n}": p.detach().float() for n, p in self.params.items()}
            opt_t, opt_steps = ckpt.optimizer_tensors(self.opt, self.names)
            tensors.update(opt_t)
            state = {"step": self.step, "total_steps": self.total_steps, "manifest_id": self.m.manifest_id,
                     "mode": "replay" if self.opts.replay else "live", "opt_steps": opt_steps,
                     "consumed": {str(s): v for s, v in sorted(self.consumed.items())},
                     "buffer": buffers, "generators": gens, "world": self.dist.world,
                     "replay_pos": getattr(self.source, "pos", None), "config": self.cfg.to_dict(),
                     "drafter_config": self.drafter.dcfg.to_dict(), "time": time.time()}
            from dflash_staged.model.weights import drafter_state_dict
            from safetensors.torch import save_file

            def write_drafter(d: Path) -> None:
                dc = self.drafter.dcfg
                (d / "config.json").write_text(dc.to_json())
                dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dc.dtype]
                save_file(drafter_state_dict(self.drafter, dt), str(d / "model.safetensors"),
                          metadata={"format": "pt"})

            ckpt.save_checkpoint(self.opts.out, self.step, write_drafter=write_drafter, tensors=tensors,
                                 state=state, keep=self.cfg.train.keep_checkpoints)
        self.ckpt_step = self.step
        self.dist.barrier()
        if self.dist.rank == 0 and isinstance(self.source, LiveSource):
            self.release_covered([j.id for j in self.m.jobs("consumed") if j.step is not None and j.step <= self.step])

    def release_covered(self, job_ids: list[int]) -> None:
        """Shards of consumed jobs covered by a durable checkpoint: delete then mark released (or keep)."""
        if not job_ids:
            return
        if not self.opts.keep_shards:
            for i in job_ids:
                j = self.m.job(i)
                self.store.delete_shard(j.epoch, j.id)
        self.m.release(job_ids, keep=self.opts.keep_shards)


# ---------------------------------------------------------------------------------------------- setup
def _wait_for_store(opts: TrainOptions, m: Manifest, progress: Progress):
    from dflash_staged.store import ShardStore
    said = False
    while not ShardStore.exists(opts.store):
        if opts.replay:
            raise DflashError(f"replay: no store at {opts.store}; give the store the live run kept (--store)")
        if m.extract_done() and not m.counts()["written"]:
            raise DflashError(f"no store at {opts.store} although {m.dir} has nothing left to extract; "
                              "check --store (it must be the path given to `dflash extract`)")
        if not said:
            print(f"train: waiting for the store at {opts.store} (start `dflash extract --manifest {m.dir} "
                  f"--store {opts.store}`)", file=sys.stderr, flush=True)
            said = True
        time.sleep(STORE_WAIT_POLL_S)
    return ShardStore.open(opts.store, expect={"manifest_id": m.manifest_id})


def _load_order(path: Path) -> dict[int, list[int]]:
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise DflashError(f"--order-from {path}: no checkpoint there to read the draw order from")
    _, state = ckpt.load_checkpoint(latest)
    return {int(s): [int(j[0]) for j in items] for s, items in state["consumed"].items()}


def _rewrite_metrics(path: Path, upto: int) -> None:
    """Keep only complete lines with step <= upto, atomically."""
    for stale in path.parent.glob(path.name + ".tmp-*"):  # a rewrite killed midway
        stale.unlink(missing_ok=True)
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= upto:
            keep.append(line)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(x + "\n" for x in keep))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_window(m: Manifest, cfg: Config, ranks: int) -> None:
    """The same arithmetic as extract: the window must hold min_ready x ranks shards (else the trainer
    could wait forever), and should hold capacity x ranks + 3 x workers + one checkpoint interval."""
    from dflash_staged.extract.worker import window_check
    w = m.meta.get("extract_window") or {"shards": cfg.extract.window, "workers": 1}
    err, warn = window_check(cfg, int(w["shards"]), int(w.get("workers", 1)), ranks)
    if err:
        raise DflashError(f"{m.dir}: extract runs with {err}")
    if warn:
        print(f"train: warning: {warn}", file=sys.stderr, flush=True)


def build_run(opts: TrainOptions) -> Run:
    from dflash_staged.model.drafter import DFlashDrafter, DraftModelConfig
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.weights import load_embed_and_head, validate_mask_token

    bound_host_memory()
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", device.index or 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist = Dist(device)
    m = Manifest.open(opts.manifest, readonly=opts.replay)
    cfg = m.config
    if opts.overrides:
        allowed = REPLAY_OVERRIDABLE if opts.replay else {"train": REPLAY_OVERRIDABLE["train"]}
        cfg = apply_overrides(cfg, opts.overrides, allowed, "train --replay" if opts.replay else "train")
    opts.out.mkdir(parents=True, exist_ok=True)
    ckpt.cleanup_tmp(opts.out)
    trainer_id = f"{dist.group_id}"
    if not opts.replay:
        m.register("train", group_id=dist.group_id, rank=dist.rank, exclusive=True, info={"out": str(opts.out)})
    if not opts.replay:
        _check_window(m, cfg, dist.world)
    store = _wait_for_store(opts, m, Progress(0, False))
    if not opts.replay and dist.rank == 0:
        store.cleanup_temp()  # half-deleted shards of a killed trainer, half-written ones of dead workers
    layer_ids = list(store.meta.layer_ids)
    num_layers, hidden, vocab = target_dims(cfg.target)
    if store.meta.hidden_size != hidden:
        raise DflashError(f"store {opts.store} holds hidden size {store.meta.hidden_size} but the target "
                          f"{cfg.target.model} has {hidden}; use the store extracted from this target")
    embed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed, head = load_embed_and_head(cfg.target, dtype=embed_dtype, device=device)
    mask_id = validate_mask_token(cfg.drafter.mask_token_id, load_tokenizer(cfg.target), vocab)
    dcfg = DraftModelConfig.from_config(cfg, hidden, vocab, num_layers, layer_ids, mask_id)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(dcfg, embed, head).to(device)

    world_steps = cfg.train.grad_accum * dist.world
    if opts.replay:
        order = _load_order(opts.order_from) if opts.order_from else None
        source = ReplaySource(m, store, passes=opts.passes, order=order)
        total = len(order) if order else -(-len(source.sequence) // world_steps)
    else:
        source = LiveSource(m, store, trainer_id, dist.rank)
        total = -(-sum(m.counts().values()) // world_steps)
    if opts.max_steps:
        total = min(total, opts.max_steps) if opts.replay else total
    buffer = ShardBuffer(store, cfg.train.buffer_capacity, verify=opts.verify)
    run = Run(opts, cfg, dist, device, m, store, drafter, source, buffer, total)
    _resume(run)
    if opts.tensorboard and dist.rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
            run._tb = SummaryWriter(str(opts.out / "tensorboard"))
        except ImportError:
            raise DflashError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return run


def _resume(run: Run) -> None:
    """Restore the newest checkpoint (if any) and reconcile the manifest with it."""
    opts, m, dist = run.opts, run.m, run.dist
    latest = ckpt.latest_checkpoint(opts.out)
    covered: dict[int, int] = {}
    if latest is None:
        if not opts.replay:
            c = m.counts()
            if c["released"] or c["kept"]:
                raise DflashError(f"{m.dir} was already partly trained ({c['released'] + c['kept']} shards consumed "
                                  f"and released) by a run whose checkpoints are not in {opts.out}; rerun with that "
                                  "run's --out to resume it, or plan a new manifest")
        state = None
    else:
        tensors, state = ckpt.load_checkpoint(latest)
        if state["manifest_id"] != m.manifest_id:
            raise DflashError(f"checkpoint {latest} belongs to manifest {state['manifest_id']}, not {m.dir} "
                              f"({m.manifest_id}); use a new --out for this manifest")
        have = state["drafter_config"]
        want = run.drafter.dcfg.to_dict()
        diffs = [f"{k}: {have.get(k)!r} -> {want.get(k)!r}" for k in sorted(set(have) | set(want))
                 if have.get(k) != want.get(k) and k not in ("dtype", "torch_dtype")]
        if diffs:
            raise DflashError(f"checkpoint {latest} was trained with another drafter config ({'; '.join(diffs[:6])}); "
                              "use a new --out for this config")
        if state.get("world", 1) != dist.world:
            raise DflashError(f"checkpoint {latest} was written by {state.get('world', 1)} rank(s), this run has "
                              f"{dist.world}; resume with the same number of trainer ranks")
        with torch.no_grad():
            for n, p in run.params.items():
                p.copy_(tensors[f"master.{n}"].to(p.device, p.dtype))
        ckpt.restore_optimizer(run.opt, run.names, tensors, state["opt_steps"])
        run.step = run.ckpt_step = int(state["step"])
        run.consumed = {int(s): v for s, v in state["consumed"].items()}
        g = state["generators"][dist.rank]
        _set_gen_state(run.draw_gen, g["draw"])
        _set_gen_state(run.anchor_gen, g["anchor"])
        if opts.replay and state.get("replay_pos") is not None:
            run.source.pos = int(state["replay_pos"])
        covered = ckpt.consumed_jobs(state)
    if not opts.replay and dist.rank == 0:
        to_release = m.resume_trainer(covered)
        run.release_covered(to_release)
    dist.barrier()
    if state is not None:
        run.source.admit_ids(run.buffer, [int(i) for i in state["buffer"][dist.rank]])
    if dist.rank == 0:
        _rewrite_metrics(run.metrics_path, run.step)
    run.progress.total = run.total_steps
