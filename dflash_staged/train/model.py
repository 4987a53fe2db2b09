"""The drafter being trained, with its numerics: device, autocast, the objective and its statistics.

On CUDA the forward runs under bf16 autocast and the frozen target embedding and LM head are
bf16; on CPU everything is fp32. Parameters are fp32 masters either way. Attention is
``train.attention`` resolved for the device (flex on CUDA by default; a clear error where the
requested path cannot run). A microbatch's loss is its weighted CE *sum*; the optimizer divides
the step's gradients by the step's total weight (see :mod:`dflash_staged.train.objective`).
"""

from __future__ import annotations

import contextlib

import torch

from dflash_staged.config import TrainConfig
from dflash_staged.model.drafter import DFlashDrafter
from dflash_staged.model.flex_blocks import resolve_attention
from dflash_staged.model.weights import write_drafter_files
from dflash_staged.errors import DflashError
from dflash_staged.train.objective import dflash_loss, noise_std_at


class DrafterModel:
    """One rank's drafter, its anchor generator and how a microbatch's loss is computed."""

    def __init__(self, drafter: DFlashDrafter, t: TrainConfig, device: torch.device, rank: int):
        self.drafter, self.t, self.device = drafter, t, device
        self.params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
        self.anchor_gen = torch.Generator(device=device).manual_seed(t.seed * 1_000_003 + 101 + rank)
        self.attention = resolve_attention(t.attention, device)

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def noise_std(self, step: int, total_steps: int) -> float:
        return noise_std_at(step, total_steps, self.t.noise_std, self.t.noise_schedule)

    def loss(self, mb: dict, noise: float):
        """(weighted CE sum, stats) of one microbatch already on the device; see :func:`dflash_loss`."""
        with self.autocast():
            return dflash_loss(self.drafter, mb, self.t.num_anchors, self.t.gamma, self.anchor_gen, noise,
                               self.t.loss_chunk, denom=1.0, attention=self.attention)

    def zero_stats(self) -> dict[str, torch.Tensor]:
        z = torch.zeros(self.block_size - 1, dtype=torch.float64, device=self.device)
        s = torch.zeros((), dtype=torch.float64, device=self.device)
        return {"correct": z.clone(), "total": z.clone(), "loss_sum": s.clone(), "weight_sum": s.clone(),
                "accepted": s.clone(), "blocks": s.clone()}

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
        diffs = [f"{k}: {have.get(k)!r} -> {want.get(k)!r}" for k in sorted(set(have) | set(want))
                 if have.get(k) != want.get(k) and k not in ("dtype", "torch_dtype")]
        if diffs:
            raise DflashError(f"checkpoint {getattr(state, 'path', '')} was trained with another drafter config "
                              f"({'; '.join(diffs[:6])}); use a new --out for this config")

    def write_drafter(self, d) -> None:
        """The servable reference-format drafter (config.json + model.safetensors) into directory ``d``."""
        write_drafter_files(self.drafter, d)
