"""The trainer, assembled from components: :func:`build_trainer` returns a :class:`Trainer` that
:func:`dflash_staged.train.loop.train_loop` drives.

Components (each owns one thing): :class:`~dflash_staged.train.trained_drafter.DrafterModel` (the drafter,
autocast, the objective), :class:`~dflash_staged.train.optim.Optimizer` (AdamW, the lr schedule),
a shard source (:mod:`dflash_staged.train.sources`: the live manifest or a kept store) feeding a
:class:`~dflash_staged.train.buffer.ShardBuffer`, the :class:`~dflash_staged.train.ledger.Ledger`
(consume, release, resume), the :class:`~dflash_staged.train.metrics.MetricsLog`, and
checkpoints (:mod:`dflash_staged.train.checkpoint`, whose docstring is the format). Every
stateful component gives and restores its own part of a checkpoint; :func:`build_trainer`
registers them, in restore order, in ``Trainer.states``: the one place to add one.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_staged.config import Config
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.manifest.layout import node_of, settle_layout, unwanted_on
from dflash_staged.preflight import existing_dir, writable_dir
from dflash_staged.procs import HOST
from dflash_staged.store import ShardStore
from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train import inputs
from dflash_staged.train.buffer import ShardBuffer, bound_host_memory, ram_line
from dflash_staged.train.catchup import newest_everywhere, record_reformation
from dflash_staged.train.distributed import Dist
from dflash_staged.train.draw import raise_together
from dflash_staged.train.ledger import Ledger
from dflash_staged.train.metrics import MetricsLog
from dflash_staged.train.optim import Optimizer
from dflash_staged.train.options import TrainOptions
from dflash_staged.train.progress import Progress
from dflash_staged.train.sources import LiveSource, ReplaySource
from dflash_staged.train.summary import end_line, resume_line
from dflash_staged.train.trained_drafter import DrafterModel, build_drafter, target_norm_for

RUN_KEY = "trainer_run"  # the manifest's record of the run that checkpoints on it: {"host", "out"}


class Generators:
    """This rank's random generators (buffer draws, anchors), as one checkpoint component."""

    per_rank = True

    def __init__(self, **gens: torch.Generator):
        self.gens = gens

    def state_dict(self) -> dict:
        return {
            "generators": {
                k: base64.b64encode(g.get_state().numpy().tobytes()).decode() for k, g in self.gens.items()
            }
        }

    def load_state_dict(self, state) -> None:
        for k, g in self.gens.items():
            g.set_state(
                torch.frombuffer(bytearray(base64.b64decode(state["generators"][k])), dtype=torch.uint8)
            )


@dataclass
class Trainer:
    """One rank's training run: its components and where it stands."""

    opts: TrainOptions
    cfg: Config
    dist: Dist
    m: Manifest
    store: ShardStore
    model: DrafterModel
    optim: Optimizer
    source: LiveSource | ReplaySource
    buffer: ShardBuffer
    ledger: Ledger
    metrics: MetricsLog
    progress: Progress
    draw_gen: torch.Generator
    total_steps: int
    step: int = 0
    states: dict[str, ckpt.Stateful] = field(default_factory=dict)  # checkpointed components, restore order
    ckpt_copy: bool = False  # this rank writes the checkpoints into its --out (own_checkpoints)
    nodes: list[str] = field(default_factory=list)  # each rank's node, in rank order
    reformed_from: tuple | None = None  # (ranks, nodes) of the checkpoint resumed on another number of ranks
    outcome: tuple | None = None  # how the loop ended, when cleanly (train.summary.end_line); None: an error

    @property
    def device(self) -> torch.device:
        return self.model.device

    def checkpoint_and_release(self) -> None:
        """Save a checkpoint covering every completed step (collective), then release what it covers."""
        if self.step == self.ledger.checkpointed:
            return
        # a trainer another one replaced (cut off past its lease) writes no checkpoint, on no rank
        raise_together(self, (lambda: None) if self.opts.replay else self.m.check_fence)
        state = ckpt.TrainerState.collect(self.states, self.dist.gather_obj)
        if self.dist.rank == 0 and not self.opts.replay:
            self._record_run()  # durable before the checkpoint it names exists
        if self.ckpt_copy:  # rank 0; with node-local stores each node's first rank too (its own --out)
            ckpt.save_checkpoint(
                self.opts.out,
                self.step,
                write_drafter=self.model.write_drafter,
                state=state,
                keep=self.cfg.train.keep_checkpoints,
            )
        self.dist.barrier()
        self.ledger.checkpoint_done(self.step)

    def _record_run(self) -> None:
        """Record in the manifest (durably, once per process) where this run checkpoints: a trainer started
        with another ``--out`` is refused while these checkpoints exist (:func:`resume`)."""
        here = {"host": HOST, "out": str(self.opts.out.resolve())}
        if self.m.meta.get(RUN_KEY) != here:
            self.m.set_meta(RUN_KEY, here)

    # -- the run's own part of a checkpoint (train.checkpoint.Stateful) -----------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "manifest_id": self.m.manifest_id,
            "store_dtype": self.store.meta.store_dtype,
            "mode": "replay" if self.opts.replay else "live",
            "world": self.dist.world,
            "nodes": self.nodes,
            "config": self.cfg.to_dict(),
            "time": time.time(),
            "chat": self.m.meta.get("chat"),
        }

    def load_state_dict(self, state) -> None:
        """Refuse a checkpoint of another manifest or store precision (and a replay's of another number of
        ranks); continue its step count. A live run may resume on another number of ranks: its
        schedule refits over the jobs left (:func:`resume`)."""
        where = getattr(state, "path", "")
        if state["manifest_id"] != self.m.manifest_id:
            raise DflashError(
                f"checkpoint {where} belongs to manifest {state['manifest_id']}, not "
                f"{self.m.address} ({self.m.manifest_id}); use a new --out for this manifest"
            )
        have, now = state.get("store_dtype", "target"), self.store.meta.store_dtype
        if have != now:  # a run keeps the precision it learned from: replays stay equal, curves comparable
            raise DflashError(
                f"checkpoint {where} was trained on a store with [extract] store_dtype = {have!r}, and store "
                f"{self.store.root} holds {now!r} hidden states: resume or replay on a store of the same "
                "precision, or use a new --out"
            )
        world = state.get("world", 1)
        if world != self.dist.world and self.opts.replay:
            raise DflashError(
                f"checkpoint {where} was written by {world} rank(s), this replay has {self.dist.world}: a "
                "replay resumes on as many ranks as it began with (its draws are a function of the ranks)"
            )
        self.step = int(state["step"])
        if self.opts.total_steps is None:
            self.total_steps = int(state["total_steps"])  # the schedule continues as it began
        if world != self.dist.world:  # a live run re-formed on fewer or more ranks (elastic, or by hand)
            done = sum(len(v) for v in state["consumed"].values())
            left = sum(self.m.counts().values()) - done
            if self.opts.total_steps is None:  # the schedule stretches or shrinks over the jobs left
                self.total_steps = self.step + -(-left // (self.cfg.train.grad_accum * self.dist.world))
            self.reformed_from = (world, state.get("nodes"))
            if self.dist.rank == 0:
                gone = (
                    "; the shards of nodes no longer in the job go back to extract"
                    if self.ledger.node
                    else ""
                )
                print(
                    f"train: resuming the checkpoint of step {self.step} ({world} rank(s)) on "
                    f"{self.dist.world}: {left} job(s) left, the schedule refitted to {self.total_steps} "
                    f"steps; new ranks start with empty buffers{gone}",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self, finished: bool = False) -> None:
        """Close every component. ``finished``: the loop returned on every rank (not an error), so the
        ranks also leave together (a barrier): torchrun ends the other ranks as soon as one exits
        with a non-zero code (a stop), and one still closing would be cut short."""
        if self.dist.rank == 0 and self.step > 0:
            self._plot()
        if self.dist.rank == 0:
            line = end_line(self.outcome, self.step, ckpt.latest_checkpoint(self.opts.out), self.opts.out)
            if line:
                print(line, file=sys.stderr, flush=True)
        self.buffer.close()
        self.ledger.close()
        if not self.opts.replay:
            try:
                if self.ledger.deletes:  # leftovers of writers that died after the last extract exited
                    unwanted = unwanted_on(self.m, self.ledger.node)
                    self.store.cleanup_temp(claimed=self.m.holds_claim, unwanted=unwanted)
                self.m.unregister_me("train")
            except DflashError as e:  # the manifest's server is gone: its lease lets the registration lapse
                print(
                    f"train: warning: could not unregister from {self.m.address}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
            self.m.close()
        self.metrics.close()
        self.progress.close()
        if finished:
            self.dist.barrier()
        self.dist.close()

    def _plot(self) -> None:
        """RUN_DIR/metrics.png, when matplotlib is installed (best effort: never fails the run)."""
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return
        from dflash_staged.train.curves import plot_metrics

        try:
            plot_metrics(self.opts.out)
        except Exception as e:  # noqa: BLE001 - a picture is not worth a failed run
            print(f"train: no metrics.png ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def build_trainer(opts: TrainOptions, extra_states: dict[str, ckpt.Stateful] | None = None) -> Trainer:
    """Open everything a run needs, resume from the newest checkpoint in ``opts.out`` if any
    (``extra_states``: more checkpointed components, restored after the built-in ones)."""
    existing_dir(opts.store, "--store")  # before anything is loaded or written
    writable_dir(opts.out, "--out")
    bound_host_memory()
    device = inputs.pick_device(opts.device)
    dist = Dist(device)
    m = Manifest.open(opts.manifest, readonly=opts.replay)
    cfg = inputs.run_config(m, opts)
    if opts.replay:
        inputs.check_replay(m, opts)  # a store with kept shards, before --out is made or a drafter built
    resuming = ckpt.latest_checkpoint(opts.out) is not None
    opts.out.mkdir(parents=True, exist_ok=True)
    nodes = dist.gather_obj(HOST)  # each rank's node
    # a replay writes nothing: with --node-local it replays this node's kept shards, else every kept shard
    if opts.replay:
        layout = "node" if opts.node_local else "shared"
    else:
        layout = settle_layout(m, opts.node_local, "dflash train")
    node = node_of(layout)
    leader = dist.rank == (nodes.index(HOST) if node else 0)  # deletes (and cleans) its node's shards
    copy = own_checkpoints(dist, opts.out, node is not None and leader)
    if copy:
        ckpt.cleanup_tmp(opts.out)
    if not opts.replay:
        m.register(
            "train", group_id=dist.group_id, rank=dist.rank, exclusive=True, info={"out": str(opts.out)}
        )
        inputs.check_window(m, cfg, nodes.count(HOST) if node else dist.world)
    store = inputs.wait_for_store(opts, m)
    if not opts.replay and leader:
        # half-deleted shards of a killed trainer, half-written ones of dead workers, stale ones
        store.cleanup_temp(claimed=m.holds_claim, unwanted=unwanted_on(m, node))
    norm = target_norm_for(cfg, store, device)  # refuses a loss on the target without its last layer
    drafter = build_drafter(
        cfg, store, device, opts.init_from, resuming=resuming, draft_vocab=m.meta.get("loss_tokens")
    )
    model = DrafterModel(
        drafter, cfg.train, device, dist.rank, norm, inputs.train_device_bytes(cfg, device), store.meta.topk,
        store.torch_dtype, store.meta.fp8,
    )  # fmt: skip
    buffer = ShardBuffer(store, cfg.train.buffer_capacity, verify=opts.verify)
    if dist.rank == 0:
        largest = max((j.real_tokens for j in m.jobs()), default=0) * store.bytes_per_token
        line = ram_line(buffer.capacity, largest, store.meta.fp8, buffer.pin)
        print(f"train: {line}", file=sys.stderr, flush=True)
    world_steps = cfg.train.grad_accum * dist.world
    if opts.replay:
        order = inputs.load_order(opts.order_from) if opts.order_from else None
        source = ReplaySource(m, store, passes=opts.passes, order=order, node=node)
        natural = len(order) if order else -(-len(source.sequence) // world_steps)
    else:
        source = LiveSource(m, store, dist.group_id, dist.rank, node=node)
        natural = -(-sum(m.counts().values()) // world_steps)
    t = Trainer(
        opts=opts,
        cfg=cfg,
        dist=dist,
        m=m,
        store=store,
        model=model,
        optim=Optimizer(model.params, cfg.train, dist),
        source=source,
        buffer=buffer,
        ledger=Ledger(
            m,
            store,
            live=not opts.replay,
            rank=dist.rank,
            keep_shards=opts.keep_shards,
            node=node,
            nodes=tuple(sorted(set(nodes))),
            node_leader=leader,
        ),
        metrics=MetricsLog(opts.out, enabled=dist.rank == 0, tensorboard=opts.tensorboard),
        progress=Progress(0, enabled=dist.rank == 0),
        draw_gen=torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + 17 + dist.rank),
        total_steps=opts.total_steps or natural,
    )
    t.ckpt_copy, t.nodes = copy, nodes
    t.states = {
        "trainer": t,
        "model": t.model,
        "optim": t.optim,
        "ledger": t.ledger,
        "source": t.source,
        "buffer": t.buffer,
        "rng": Generators(draw=t.draw_gen, anchor=t.model.anchor_gen),
        **(extra_states or {}),
    }
    resume(t)
    t.progress.total = t.total_steps
    return t


def own_checkpoints(dist: Dist, out: Path, node_leader: bool) -> bool:
    """Whether this rank writes each checkpoint into its ``out``: rank 0 always; with node-local stores
    also the first rank of every other node whose ``out`` is not rank 0's (a directory on its own disk,
    seen by a marker file rank 0 creates), so that every node holds every checkpoint and a trainer
    rerun without any one node (rank 0's included) resumes from its own disk (collective)."""
    token = dist.gather_obj(uuid.uuid4().hex)[0]
    marker = Path(out) / f".rank0-{token}"
    if dist.rank == 0:
        marker.touch()
    dist.barrier()
    sees = marker.exists()
    dist.barrier()
    if dist.rank == 0:
        marker.unlink(missing_ok=True)
    return dist.rank == 0 or (node_leader and not sees)


def refuse_another_run(m: Manifest, out) -> None:
    """A new run (no checkpoint in ``out``) on a manifest that another run checkpointed: refused while
    that run's checkpoints exist (on another host: always). Its record, not the manifest's states,
    decides what it trained: on SQLite a power loss can undo its consumes (relaxed commits)."""
    prev = m.meta.get(RUN_KEY)
    if not prev or prev.get("out") == str(out.resolve()):
        return
    if prev.get("host") == HOST and ckpt.latest_checkpoint(Path(prev["out"])) is None:
        return  # its checkpoints are gone: nothing records what it trained
    raise DflashError(
        f"{m.address} is being trained by the run in {prev['out']} (host {prev.get('host')}), whose "
        f"checkpoints record what it trained; rerun with --out {prev['out']} to resume it (that also "
        "repairs the manifest after a power loss), or plan a new manifest"
    )


def resume(t: Trainer) -> None:
    """Restore the newest checkpoint (if any) and reconcile the manifest with it."""
    opts, m, dist = t.opts, t.m, t.dist
    latest = newest_everywhere(dist, opts.out, t.ckpt_copy)  # a node that was away catches up first
    if latest is None and not opts.replay:
        c = m.counts()
        if c["released"] or c["kept"]:
            raise DflashError(
                f"{m.address} was already partly trained ({c['released'] + c['kept']} shards consumed "
                f"and released) by a run whose checkpoints are not in {opts.out}; rerun with that "
                "run's --out to resume it, or plan a new manifest"
            )
        refuse_another_run(m, opts.out)
    elif latest is not None:
        ckpt.load_checkpoint(latest).restore(t.states, dist.rank)
        if dist.rank == 0:
            print(resume_line(t.step, latest), file=sys.stderr, flush=True)
        record_reformation(t)
    t.ledger.reconcile()
    dist.barrier()
    t.ledger.release_node()  # node-local stores: each node's covered shards, by its leader
    if t.buffer.to_readmit:
        t.source.admit_ids(t.buffer, t.buffer.to_readmit)
    dist.barrier()  # every rank has its checkpointed buffer back before any takes new shards
    t.metrics.truncate(t.step)
