"""The drafter being trained: how it is built and initialised (:func:`build_drafter`: the target's
frozen embedding and head, the target's top layers or another run's weights), and its numerics
(:class:`DrafterModel`: device, autocast, the objective and its statistics).

On CUDA the forward runs under bf16 autocast and the frozen target embedding and LM head are
bf16; on CPU everything is fp32, unless ``train.cpu_bf16`` puts the drafter's forward under bf16
autocast on a CPU with bf16 instructions (the head and the loss stay fp32). Parameters are fp32
masters either way. Attention is ``train.attention`` resolved for the device (flex on CUDA by
default; a clear error where the requested path cannot run). A microbatch's loss is its weighted CE
*sum*; the optimizer divides the step's gradients by the step's total weight (see
:mod:`dflash_staged.train.objective`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from dflash_staged.config import Config, TrainConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.backbone import DFlashDrafter
from dflash_staged.model.drafters.engines import check_servable
from dflash_staged.model.drafters.flex import resolve_attention
from dflash_staged.model.drafters.weights import write_drafter_files
from dflash_staged.model.run_drafter import run_drafter_config, store_problem
from dflash_staged.model.target.weights import load_final_norm
from dflash_staged.store import ShardStore
from dflash_staged.store.fp8 import dequantize
from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.memory import estimate, row_budget
from dflash_staged.train.objective import dflash_loss, noise_std_at, zero_stats
from dflash_staged.train.objective.selector import alpha_at


class Knobs(NamedTuple):
    """The loss settings that follow a schedule over the steps."""

    noise_std: float
    selector_alpha: float
    target_metrics: bool = False  # a logging step: recompute the target's logits for its metrics too
    step: int = 0  # the optimizer step and the run's length (a family's own schedules)
    total_steps: int = 0


class DrafterModel:
    """One rank's drafter, its anchor generator and how a microbatch's loss is computed."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        t: TrainConfig,
        device: torch.device,
        rank: int,
        target_norm: torch.nn.Module | None = None,
        device_bytes: int | None = None,
        store_topk: int = 0,
        hidden_dtype: torch.dtype = torch.float32,
        fp8: bool = False,
    ):
        """``hidden_dtype``: the store's logical dtype, which FP8 states (``fp8``: the store holds them)
        are dequantized into on the device (:meth:`loss`)."""
        self.drafter, self.t, self.device, self.target_norm = drafter, t, device, target_norm
        self.serving = check_servable(drafter.dcfg)  # refuses what every engine mis-serves; else warnings
        self.hidden_dtype = hidden_dtype
        # the target's distribution: from its last layer (target_norm), else from the store's top-k
        self.store_topk = 0 if target_norm is not None else int(store_topk)
        self.has_target = target_norm is not None or self.store_topk > 0
        selector = getattr(drafter, "selector", None)
        if selector is not None and t.selector_alpha == 0:  # as SpecForge: no selector term, no training
            selector.requires_grad_(False)
        self.params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
        self.anchor_gen = torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + 101 + rank)
        self.attention = resolve_attention(t.attention, device)
        self.cpu_bf16 = device.type == "cpu" and cpu_bf16(t.cpu_bf16)
        drafter.activation_checkpointing = t.activation_checkpointing
        # the target's logits in the head: for the loss, or (a store with its last layer) for the metrics
        self.memory = estimate(
            drafter, t, device, device_bytes, target_logits=self.has_target, topk=self.store_topk,
            fp8=fp8,
        )  # fmt: skip
        self.max_rows = row_budget(self.memory, t, drafter.block_size)  # 0 = no cap
        if device.type == "cuda" and rank == 0:
            print(f"train: {self.memory.line(self.max_rows)}", file=sys.stderr, flush=True)

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.cpu_bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def knobs(self, step: int, total_steps: int) -> Knobs:
        """The scheduled settings of the loss at ``step``."""
        t = self.t
        return Knobs(
            noise_std_at(step, total_steps, t.noise_std, t.noise_schedule),
            alpha_at(step, total_steps, t.selector_alpha, t.selector_warmup_ratio, t.selector_ramp_ratio),
            self.has_target and (step + 1) % t.log_every == 0,
            step,
            total_steps,
        )

    def loss(self, mb: dict, knobs: Knobs):
        """(weighted loss sum, stats) of one microbatch already on the device; see :func:`dflash_loss`.
        The target's logits are recomputed when the loss needs them, and for the metrics every
        ``train.log_every`` steps (when the store has the target's last layer). FP8 states (the batch
        holds ``hidden_scale``) are dequantized here, on the device."""
        if "hidden_scale" in mb:
            mb = dict(mb)
            mb["hidden"] = dequantize(mb["hidden"], mb.pop("hidden_scale"), self.hidden_dtype)
        wants = self.t.needs_target or self.drafter.family.needs_target or knobs.target_metrics
        norm = self.target_norm if wants else None
        topk = self.t.target_topk if wants and self.store_topk else None
        with self.autocast():
            return dflash_loss(
                self.drafter,
                mb,
                self.t.num_anchors,
                self.t.gamma,
                self.anchor_gen,
                knobs.noise_std,
                self.t.loss_chunk,
                denom=1.0,
                attention=self.attention,
                position_weights=self.t.position_weights,
                dpace_alpha=self.t.dpace_alpha,
                selector_alpha=knobs.selector_alpha,
                selector_stop_gradient=self.t.selector_stop_gradient,
                terms=self.t.loss,
                target_norm=norm,
                distill_temperature=self.t.distill_temperature,
                lk_eta=self.t.lk_eta,
                selector_labels=self.t.selector_labels,
                step=knobs.step,
                total_steps=knobs.total_steps,
                target_topk=topk,
            )

    def zero_stats(self) -> dict[str, torch.Tensor]:
        return zero_stats(self.drafter.proposals + 1, self.device, extra=self.drafter.family.stats)

    @staticmethod
    def add_stats(acc: dict, st: dict) -> None:
        for k in acc:
            acc[k] += st[k].detach().to(acc[k].dtype)

    def state_dict(self) -> dict:
        """The drafter's config (train.checkpoint.Stateful; its weights are the optimizer's masters,
        and the servable drafter files are written beside the state by :meth:`write_drafter`)."""
        return {"drafter_config": self.drafter.dcfg.to_dict()}

    def load_state_dict(self, state) -> None:
        """Refuse a checkpoint of another drafter config (the dtype may differ)."""
        have, want = state["drafter_config"], self.drafter.dcfg.to_dict()
        if have.get("architectures") != want.get("architectures"):
            raise DflashError(
                f"checkpoint {getattr(state, 'path', '')} holds a {have.get('architectures')} drafter and "
                f"this run trains a {want.get('architectures')} one (drafter.architecture = "
                f"{self.drafter.family.name!r}): a resume keeps its drafter family; use a new --out"
            )
        diffs = [
            f"{k}: {have.get(k)!r} -> {want.get(k)!r}"
            for k in sorted(set(have) | set(want))
            if have.get(k) != want.get(k) and k not in ("dtype", "torch_dtype")
        ]
        if diffs:
            raise DflashError(
                f"checkpoint {getattr(state, 'path', '')} was trained with another drafter config "
                f"({'; '.join(diffs[:6])}); use a new --out for this config"
            )

    def write_drafter(self, d) -> None:
        """The servable reference-format drafter (config.json + model.safetensors) into directory ``d``; the
        first one a run writes also prints what serving engines would refuse or mis-serve in it."""
        write_drafter_files(self.drafter, d)
        for line in self.serving:
            print(f"train: serving: {line}", file=sys.stderr, flush=True)
        self.serving = []


def target_norm_for(cfg: Config, store: ShardStore, device: torch.device) -> torch.nn.Module | None:
    """The target's final norm when the store holds its last layer (None otherwise: the target's
    distribution then comes from the store's top-k, if it holds them). A drafter family or a loss that
    needs the target's distribution from a store with neither is refused here, before any step, and so
    is a top-k taken at another temperature than the terms use."""
    meta = store.meta
    why = store_problem(
        cfg,
        meta.last_layer is not None,
        meta.topk,
        meta.topk_temperature,
        f"store {store.root} holds",
        "plan with {what} and extract again",
    )
    if why:
        raise DflashError(why)
    if meta.last_layer is not None:
        return load_final_norm(cfg.target, device)
    if meta.topk and not meta.topk_tail:
        print(
            f"train: store {store.root} holds the target's top-{meta.topk} without the tail's mass "
            "(written before it was stored): the tail is taken as 1 - the sum of the fp16 entries, "
            "unreliable below ~1e-4 on peaked rows; extract again into a new store to keep it exactly",
            file=sys.stderr,
            flush=True,
        )
    return None


def build_drafter(
    cfg: Config,
    store: ShardStore,
    device: torch.device,
    init_from: Path | None = None,
    resuming: bool = False,
    draft_vocab: dict | None = None,
):
    """A freshly initialised drafter for this target and store, with the frozen embedding and head;
    ``init_from`` (``--init-from``): start from another run's (or checkpoint's) weights instead;
    ``resuming``: a checkpoint's weights will replace them, so no initialisation from the target;
    ``draft_vocab``: the manifest's loss-token counts, whence the draft vocabulary (``draft_vocab_size``)."""
    from dflash_staged.model.drafters.backbone import DFlashDrafter
    from dflash_staged.model.drafters.weights import validate_mask_token
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.model.target.weights import load_embed_and_head

    dims = target_dims(cfg.target)
    if store.meta.hidden_size != dims.hidden_size:
        raise DflashError(
            f"store {store.root} holds hidden size {store.meta.hidden_size} but the target "
            f"{cfg.target.model} has {dims.hidden_size}; use the store extracted from this target"
        )
    embed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed, head = load_embed_and_head(cfg.target, dtype=embed_dtype, device=device)
    mask_id = validate_mask_token(cfg.drafter.mask_token_id, load_tokenizer(cfg.target), dims.vocab_size)
    from_target = cfg.drafter.init != "random"  # target_top, or auto
    dcfg = run_drafter_config(cfg, dims, list(store.meta.layer_ids), mask_id)
    ids = planned_vocab(dcfg, draft_vocab)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(dcfg, embed, head, ids)
    if from_target and init_from is None and not resuming:  # (a warm start or checkpoint replaces them)
        drafter = init_from_target_layers(cfg, drafter, lambda: DFlashDrafter(dcfg, embed, head, ids))
    if init_from is not None:
        src = warm_start(drafter, init_from)
        print(f"train: drafter initialised from {src}", file=sys.stderr, flush=True)
    return drafter.to(device)


def cpu_bf16(setting: str) -> bool:
    """``train.cpu_bf16``: whether a CPU trainer runs under bf16 autocast (the CPU's flags decide "auto";
    "on" is refused where the CPU has no bf16 instructions)."""
    if setting == "off":
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    has = sorted(flags & {"amx_bf16", "avx512_bf16"})
    if setting == "on" and not has:
        raise DflashError(
            "train.cpu_bf16 = 'on', but this CPU lists neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo: "
            "bf16 would be emulated, slower than float32; set it to 'auto' or 'off'"
        )
    if has:
        print(f"train: bf16 autocast on this CPU ({', '.join(has)})", file=sys.stderr, flush=True)
    return bool(has)


def planned_vocab(dcfg, record: dict | None) -> torch.Tensor | None:
    """The draft vocabulary of ``drafter.draft_vocab_size`` from the manifest's loss-token counts
    (``record``; :mod:`dflash_staged.model.drafters.vocab`), or None without one."""
    n = dcfg.draft_vocab_size
    if not n:
        return None
    if record is None:
        raise DflashError(
            f"drafter.draft_vocab_size = {n}, but the manifest holds no loss-token counts to choose it from "
            "(planned by an older version): plan again"
        )
    from dflash_staged.model.drafters import vocab

    v = vocab.choose(vocab.counts_of(record), n)
    print(f"train: {v.line(dcfg.vocab_size)}", file=sys.stderr, flush=True)
    return torch.as_tensor(v.ids, dtype=torch.long)


def init_from_target_layers(cfg: Config, drafter, fresh):
    """``drafter.init``: target_top copies the target's top layers (or fails, naming the fix); auto
    does so where they fit and otherwise keeps random weights (``fresh()``, same seed), saying why."""
    from dflash_staged.model.drafters.init import init_from_target

    try:
        copied = init_from_target(drafter, cfg.target)
    except DflashError as e:
        if cfg.drafter.init == "target_top":
            raise
        torch.manual_seed(cfg.train.seed)
        print(
            f"train: drafter.init = 'auto': random weights, the target's layers do not fit ({e})",
            file=sys.stderr,
            flush=True,
        )
        return fresh()
    print(
        f"train: drafter initialised from the target ({len(copied)} tensors; {copied[0]}, ...)",
        file=sys.stderr,
        flush=True,
    )
    return drafter


def warm_start(drafter, path: Path) -> Path:
    """Copy a checkpoint's drafter weights (its fp32 masters when it has them) into ``drafter``."""
    from safetensors.torch import load_file

    ck = ckpt.resolve_checkpoint(path, "--init-from")
    from dflash_staged.model.drafters.weights import read_drafter_config

    theirs = read_drafter_config(ck).family
    if theirs is not drafter.family:
        raise DflashError(
            f"--init-from {ck}: it is a {theirs.name} drafter ({theirs.architecture}) and this run trains a "
            f"{drafter.family.name} one ({drafter.family.architecture}); warm-start from a drafter of the "
            "same family"
        )
    from dflash_staged.train.checkpoint import trainer_tensors_file

    masters = trainer_tensors_file(ck)
    if masters.is_file():
        state = {
            k[len("master.") :]: v for k, v in load_file(str(masters)).items() if k.startswith("master.")
        }
    else:
        state = load_file(str(ck / "model.safetensors"))
    own = dict(drafter.named_parameters())
    bad = sorted(set(own) ^ set(state)) or [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise DflashError(
            f"--init-from {ck}: its drafter does not fit this one ({bad[0]} and {len(bad) - 1} more "
            "differ); warm-start from a drafter of the same layers and sizes"
        )
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(state[k].to(p.dtype))
    return ck
