"""The drafter's optimizer: AdamW over the trainable parameters, the learning-rate schedule,
gradient all-reduce and clipping, and the optimizer's part of a checkpoint."""

from __future__ import annotations

import math

import torch

from dflash_staged.config import TrainConfig


def lr_at(
    step: int,
    total: int,
    base: float,
    warmup_ratio: float,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
) -> float:
    """The learning rate of step ``step`` (completed steps, 0-based) of ``total``: linear warmup over
    ``warmup_ratio`` of the steps, then ``cosine`` decay to zero, or ``wsd``: stable at ``base``, then
    a linear decay to zero over the last ``decay_ratio`` of the steps."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return base * (step + 1) / warm
    if schedule == "wsd":
        decay = max(1, int(round(decay_ratio * total)))
        return base * min(1.0, max(0.0, (total - step) / decay))
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return base * 0.5 * (1 + math.cos(math.pi * progress))


class Optimizer:
    """AdamW over named parameters (fp32 masters), stepped once per optimizer step."""

    def __init__(self, params: dict[str, torch.nn.Parameter], t: TrainConfig, dist):
        self.params, self.t, self.dist = params, t, dist
        self.names = {p: n for n, p in params.items()}
        self.opt = torch.optim.AdamW(
            list(params.values()), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, eps=1e-8
        )

    def lr(self, step: int, total_steps: int) -> float:
        return lr_at(
            step, total_steps, self.t.lr, self.t.warmup_ratio, self.t.lr_schedule, self.t.decay_ratio
        )

    def reduce_gradients(self, weight_sum: torch.Tensor | None = None) -> None:
        """Sum the gradients over ranks and, given this rank's loss weight sum for the step, divide
        them by the step's total over all ranks (one all-reduce for both): the gradient of the
        step's weighted mean loss when each microbatch backpropagated its weighted sum."""
        params = list(self.params.values())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        total = [] if weight_sum is None else [weight_sum.detach().reshape(1).to(params[0].grad).clone()]
        self.dist.all_reduce_([p.grad for p in params] + total)
        if total:
            torch._foreach_mul_([p.grad for p in params], 1.0 / total[0][0].clamp_min(1e-6))

    def step(self, lr: float, weight_sum: torch.Tensor | None = None) -> bool:
        """:meth:`reduce_gradients`, clip, apply at ``lr``, zero the gradients. A gradient that is not
        finite (an inf or a NaN anywhere: a non-finite loss) is not applied; returns whether it was.
        The gradients are all-reduced first, so every rank decides alike (no collective of its own);
        one host sync per step."""
        self.reduce_gradients(weight_sum)
        params = list(self.params.values())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        finite = bool(torch.isfinite(norm))
        if finite:
            if self.t.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.t.grad_clip, norm)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return finite

    # -- checkpoint (train.checkpoint.Stateful) ------------------------------------------------------
    def state_dict(self) -> dict:
        """fp32 masters and AdamW moments as flat named tensors (see the checkpoint format), and
        AdamW's step count ``opt_steps``."""
        out: dict = {f"master.{n}": p.detach().float() for n, p in self.params.items()}
        steps = 0
        for p, st in self.opt.state.items():
            if st:
                n = self.names[p]
                out[f"opt.{n}.exp_avg"] = st["exp_avg"]
                out[f"opt.{n}.exp_avg_sq"] = st["exp_avg_sq"]
                steps = int(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
        return {**out, "opt_steps": steps}

    def load_state_dict(self, state) -> None:
        steps = float(state["opt_steps"])
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state[f"master.{n}"].to(p.device, p.dtype))
        for n, p in self.params.items():
            if f"opt.{n}.exp_avg" in state:
                self.opt.state[p] = {
                    "step": torch.tensor(steps),
                    "exp_avg": state[f"opt.{n}.exp_avg"].to(p.device, p.dtype),
                    "exp_avg_sq": state[f"opt.{n}.exp_avg_sq"].to(p.device, p.dtype),
                }
