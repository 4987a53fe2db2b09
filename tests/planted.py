"""Drafters the tiny target mostly agrees with, for the decode comparisons against the references.

A drafter straight from ``init_from_target`` drafts what the tiny (random) target rarely accepts, so a
decode comparison would compare little more than rejections. Here the target is made predictable and
the drafter is fitted to it, cheaply on a CPU:

* :func:`planted_target` is the tiny target with its final norm scaled by :data:`SHARPEN` (its logits
  scaled alike): its greedy tokens are the same, and its T = 1 distribution, nearly uniform before, is
  all but one-hot on them, so a sampled decode follows the greedy one the drafter learnt;
* :func:`fit_to_target` trains the drafter, through the project's own objective (``dflash_loss``, the
  drafter family's terms), on the target's greedy continuations of the very prompts the test decodes:
  the drafter learns those continuations, so most drafts are accepted (each test asserts how many).
  Its final norm is first scaled by ``temperature_scale`` (its logits alike): a drafter starting
  sharper than the target's top layers gets peaked in a hundred steps, so that at T = 1 its draws are
  mostly the learnt token and still sometimes another (both the accepting and the rejecting branch run).

Both sides of a comparison then run the same trained checkpoint against the same planted target.
"""

from __future__ import annotations

import torch

from dflash_staged.config import TargetConfig
from dflash_staged.model.target import Target, load_target
from dflash_staged.train.objective import dflash_loss

SHARPEN = 1e4


def planted_target(layer_ids=(1, 3)) -> Target:
    """The tiny target (``tiny:qwen3``, its own copy) with its logits scaled by :data:`SHARPEN`."""
    return sharpen(load_target(TargetConfig(model="tiny:qwen3"), "cpu", layer_ids=list(layer_ids)), SHARPEN)


def acceptance(out, steps=None) -> tuple[int, int]:
    """(drafts accepted, drafts verified) of a ``speculative_generate`` output, over ``steps`` (indices of
    verify steps; all by default). A step commits its accepted drafts and one token of the target's."""
    steps = range(len(out.accepted)) if steps is None else steps
    return sum(out.accepted[k] - 1 for k in steps), sum(out.verified[k] - 1 for k in steps)


def sharpen(target: Target, factor: float) -> Target:
    """Scale ``target``'s final norm weight by ``factor`` in place (the model is the test's own)."""
    with torch.no_grad():
        target._final_norm().weight.mul_(factor)
    return target


def greedy_continuation(target: Target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``prompt`` followed by the target's ``n`` greedy tokens (one token a forward, with its cache)."""
    logits, _, cache = target.forward_with_taps(prompt[None])
    ids = [int(logits[0, -1].argmax())]
    for _ in range(n - 1):
        logits, _, cache = target.forward_with_taps(torch.tensor([[ids[-1]]]), cache)
        ids.append(int(logits[0, -1].argmax()))
    return torch.cat([prompt, torch.tensor(ids)])


def fit_to_target(
    drafter,
    target: Target,
    prompts: list[torch.Tensor],
    new_tokens: int,
    *,
    steps: int = 100,
    lr: float = 3e-3,
    num_anchors: int = 24,
    seed: int = 0,
    gamma: float = 4.0,
    options: dict | None = None,
    temperature_scale: float = 6.0,
    **loss_options,
) -> float:
    """Train ``drafter`` in place on the target's greedy continuations of ``prompts`` (``new_tokens`` +
    a block each, the prompt masked out), its final norm first scaled by ``temperature_scale``; returns
    the last step's loss. ``options`` override the drafter's options while it is fitted
    (its objective's weights, say; restored after)."""
    B = drafter.block_size
    seqs = [greedy_continuation(target, p, new_tokens + B) for p in prompts]
    with_last = drafter.family.needs_target  # learns from the target's distribution: its last layer too
    tapped = Target(target.model, target.layer_ids, target.target_id, target.device, last_layer=with_last)
    hidden = torch.cat([tapped.capture(s[None])[0] for s in seqs])
    ids = torch.cat(seqs)
    mask = torch.cat(
        [torch.cat([torch.zeros(len(p)), torch.ones(len(s) - len(p))]) for p, s in zip(prompts, seqs)]
    )
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    batch = {"hidden": hidden, "input_ids": ids, "loss_mask": mask, "cu_seqlens": cu}
    norm = target._final_norm() if with_last else None
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        drafter.norm.weight.mul_(temperature_scale)
    saved = dict(drafter.dcfg.options)
    drafter.dcfg.options.update(options or {})
    drafter.train()
    for step in range(steps):
        loss, _ = dflash_loss(
            drafter,
            batch,
            num_anchors,
            gamma,
            g,
            target_norm=norm,
            step=step,
            total_steps=steps,
            **loss_options,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    drafter.eval()
    drafter.dcfg.options.clear()
    drafter.dcfg.options.update(saved)
    return float(loss.detach())
