"""A training rank's device memory, known before the first step; the drafter-row budget.

The drafter's activations grow with its *rows* (anchors x block size), not with the context
tokens that ``train.microbatch_tokens`` caps: a shard of short sequences holds thousands of
anchors. So each microbatch is also capped by rows (``train.microbatch_rows``; 0 = derived
here from the device's memory) and :func:`estimate` states the peak it expects:

* **fixed**: the trainable parameters' fp32 masters, fp32 gradients and AdamW's two fp32
  moments, plus their bf16 autocast copies on CUDA (18 bytes a parameter; 16 on CPU), and the
  frozen target embedding and LM head (bf16 on CUDA, fp32 on CPU);
* **per row**: ``ROW_ELEMS x (hidden + intermediate)`` saved elements per drafter layer, in the
  activation dtype (measured with saved-tensor hooks, each saved storage counted once: 6.0 to 7.1
  over geometries from hidden 256 to 512; tests/test_memory.py checks it within 20%, and down to
  one layer at the Qwen3-8B shapes in bf16), and the chunked head's gradient to the drafter's
  states (``hidden`` a row, kept from the forward to the backward). With
  ``train.activation_checkpointing`` a layer keeps only its input, the fp32 residual stream
  (``4 x hidden`` bytes a row), and one layer is recomputed at a time;
* **per context token**: the taps read from the shard (and their FP8 copy and scales when the store
  holds FP8), the fused context and each layer's context keys and values;
* **the loss**: one ``train.loss_chunk`` of fp32 logits, their softmax and gradient
  (:data:`LOSS_BUFFERS`); with a term on the target's distribution also the target's logits (or the
  distribution formed from its top-k), both sides' log-probabilities and probabilities
  (:data:`TARGET_LOSS_BUFFERS`), and the target's last layer (or its top-k) among the context tokens'
  inputs;
* **the family's own** (:meth:`~dflash_staged.model.drafters.family.Family.memory`): DFlash2's
  convolutions and selector candidates, DSpark's Markov and confidence heads, DSpine's injection,
  refinement and transfer codes, each family's figures in its own folder;
* **flex padding** (CUDA): ``flex_attention`` takes the rows padded to a power of two
  (:mod:`dflash_staged.model.drafters.flex`), and keeps q, the blocks' k and v and its output for
  every padding row too (``pad_row`` a padding row, a layer); and a microbatch holds at most
  ``row_cap`` rows, so the padded q's offsets (rows x heads x head size) stay below 2**31.

The row budget fills ``USABLE`` of the device's memory; when even one sequence's blocks
(``train.num_anchors x block_size`` rows) cannot fit, :func:`row_budget` refuses, naming the
settings to change. On CPU there is no row cap unless one is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_staged.config import TrainConfig
from dflash_staged.errors import DflashError
from dflash_staged.store.meta import TOPK_TAIL_BYTES, TOPK_TOKEN_BYTES

ROW_ELEMS = 6.5  # saved elements a row per layer, in units of (hidden + intermediate), each saved once
LOSS_BUFFERS = 3  # fp32 [loss_chunk, vocab] tensors of the head with ce alone: logits, softmax, gradient
TARGET_LOSS_BUFFERS = 10  # ... with the target's logits: both sides' logits and softmaxes, the terms
USABLE = 0.85  # share of the device's memory the estimate may fill (allocator slack, CUDA context)
GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training rank at the configured shapes (see the module docstring)."""

    fixed: int  # weights, gradients, optimizer state, frozen embedding and head
    per_row: int  # drafter activations of one row (anchor x block position)
    context: int  # activations of one microbatch's context tokens
    loss: int  # one loss chunk's logits
    device_bytes: int  # the device's memory (0: unknown, e.g. CPU)
    pad_row: int = 0  # flex (CUDA): what a padding row costs (rows are padded to a power of two)
    row_cap: int = 0  # flex: the most rows whose padded q/k/v offsets stay below 2**31 (0: none)

    def padded(self, rows: int) -> int:
        """The rows flex pads ``rows`` to (itself without flex)."""
        return max(rows, 1 << max(0, rows - 1).bit_length()) if self.pad_row else rows

    def peak(self, rows: int) -> int:
        pad = (self.padded(rows) - rows) * self.pad_row
        return self.fixed + self.context + self.loss + rows * self.per_row + pad

    @property
    def max_rows(self) -> int:
        """The most rows a microbatch may hold on this device (0: no cap, the device is unknown): the
        most whose :meth:`peak` (its padding included) fits, and at most :attr:`row_cap`."""
        if not self.device_bytes:
            return self.row_cap
        room = int(self.device_bytes * USABLE) - self.fixed - self.context - self.loss
        rows = max(0, room // self.per_row)
        if self.row_cap:
            rows = min(rows, self.row_cap)
        while rows and self.peak(rows) - (self.fixed + self.context + self.loss) > room:
            b = self.padded(rows)  # within one bucket peak grows with rows: the most that fit in it
            fit = (room - b * self.pad_row) // max(1, self.per_row - self.pad_row)
            rows = fit if fit > b // 2 else min(rows - 1, b // 2)  # else the bucket below
        return max(0, rows)

    def line(self, rows: int) -> str:
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        dev = f" of {g(self.device_bytes)}" if self.device_bytes else ""
        return (
            f"memory: weights, gradients and optimizer {g(self.fixed)}, {self.per_row / 2**20:.2f} MiB "
            f"a drafter row x {rows:,} rows a microbatch, context {g(self.context)}, loss chunk "
            f"{g(self.loss)}: peak about {g(self.peak(rows))}{dev}"
        )


def estimate(
    drafter,
    t: TrainConfig,
    device: torch.device,
    device_bytes: int | None = None,
    target_logits: bool = False,
    topk: int = 0,
    fp8: bool = False,
) -> MemoryEstimate:
    """The estimate for ``drafter`` (its config and the sizes of its trainable and frozen tensors;
    it may live on the meta device) trained under ``t`` on ``device``, whose memory is
    ``device_bytes`` (default: the CUDA device's; none on CPU); ``target_logits``: the loss also
    recomputes the target's logits (a term on its distribution: ``train.loss``), from its last layer or,
    with ``topk``, from its stored top-k (read beside the taps instead of the last layer); ``fp8``: the
    states arrive in FP8 and are dequantized on the device (their one-byte copy and scales too)."""
    c = drafter.dcfg
    cuda = device.type == "cuda"
    act = 2 if cuda else 4  # bf16 autocast on CUDA, fp32 on CPU
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = drafter.embed_weight.numel() + drafter.lm_head_weight.numel()
    H, inter, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    layer_row = int(ROW_ELEMS * (H + inter))
    # checkpointing keeps each layer's input, the fp32 residual stream, and recomputes one layer at a time
    rows_elems = layer_row if t.activation_checkpointing else L * layer_row
    ckpt_row = L * H * 4 if t.activation_checkpointing else 0
    head_row = H * act  # the chunked head's gradient to the drafter's states, kept from forward to backward
    family_fixed, family_row = c.family.memory(c, c.options, t.activation_checkpointing, act)
    taps = len(c.target_layer_ids)
    kv = 2 * c.num_key_value_heads * c.head_dim
    taps += 1 if target_logits and not topk else 0  # the target's last layer, read beside the taps
    ctx_elems = t.microbatch_tokens * (taps * H + 2 * H + L * kv * (1 if t.activation_checkpointing else 2))
    top_bytes = topk * TOPK_TOKEN_BYTES + (TOPK_TAIL_BYTES if topk else 0)  # ids, log-probabilities, tail
    ctx_elems += t.microbatch_tokens * top_bytes // act  # (the top-k, read instead of the last layer)
    ctx_elems += t.microbatch_tokens * taps * (H + 4) // act if fp8 else 0  # the FP8 copy and its scales
    if device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    q_row = c.num_attention_heads * c.head_dim  # flex pads q (and the blocks' k, v, its output) by row
    pad_row = L * (2 * q_row + kv) * act if cuda else 0  # q and its output; the blocks' k and v
    row_cap = 1 << ((2**31 - 1) // q_row).bit_length() - 1 if cuda else 0
    return MemoryEstimate(
        fixed=trainable * (18 if cuda else 16) + frozen * act + family_fixed,
        per_row=rows_elems * act + ckpt_row + head_row + family_row,
        context=ctx_elems * act,
        loss=(TARGET_LOSS_BUFFERS if target_logits else LOSS_BUFFERS)
        * min(t.loss_chunk, t.microbatch_tokens * c.block_size)
        * (c.draft_vocab_size or c.vocab_size)  # (the head's rows: a draft vocabulary's)
        * 4,
        device_bytes=device_bytes,
        pad_row=pad_row,
        row_cap=row_cap,
    )


def row_budget(est: MemoryEstimate, t: TrainConfig, block_size: int) -> int:
    """Rows a microbatch may hold: ``train.microbatch_rows`` if set, else what fits the device (0 =
    no cap: CPU). Refuses a budget below one sequence's blocks (a sequence is never split)."""
    need = t.num_anchors * block_size
    if t.microbatch_rows:
        if t.microbatch_rows < need:
            raise DflashError(
                f"train.microbatch_rows={t.microbatch_rows} is below one sequence's {need:,} rows "
                f"(train.num_anchors={t.num_anchors} x block size {block_size}), and a sequence is never "
                "split: raise it, or lower train.num_anchors"
            )
        return t.microbatch_rows
    if not est.device_bytes:
        return 0
    if est.max_rows < need:
        hints = [] if t.activation_checkpointing else ["set train.activation_checkpointing = true"]
        hints += ["lower train.num_anchors", "lower train.microbatch_tokens or train.loss_chunk"]
        raise DflashError(
            f"train: {est.line(need)}, over {USABLE:.0%} of the device: one sequence's {need:,} rows "
            f"(train.num_anchors={t.num_anchors} x block size {block_size}) do not fit; "
            + ", or ".join(hints)
        )
    return est.max_rows
