"""The DFlash rule as a ``flex_attention`` block mask: the block-sparse training path (default on CUDA).

* **Layout.** One row of queries, every anchor's block (anchors sorted, ``B`` queries each),
  against one row of keys: the packed context of every sequence, then the blocks. The
  ``mask_mod`` is :mod:`dflash_staged.model.block_attention`'s rule plus "same sequence";
  padding sees nothing and is seen by nothing. ``flex_attention`` skips every 128x128 tile
  the mask leaves empty, so the work follows what each anchor can see (context before it,
  its own block) instead of the padded whole.
* **GQA** with ``enable_gqa=True``: K/V are never repeated.
* **Compiled once per shape bucket.** Query and key lengths are padded up to powers of two
  (at least 128), so ``torch.compile`` builds ``flex_attention`` and the mask once per bucket
  and never per step; padding costs memory, not compute (its tiles are empty).
* **Where.** CUDA with Triton. ``flex_attention`` has no backward pass on CPU in the torch
  versions this package supports, so training there uses the SDPA path and
  ``train.attention = "flex"`` is an error (:func:`resolve_attention`).
"""

from __future__ import annotations

import importlib
import warnings

import torch

from dflash_staged.config import ATTENTION_CHOICES
from dflash_staged.errors import DflashError
from dflash_staged.model.block_attention import Packing, block_visible, context_visible

MIN_BUCKET = 128
RECOMPILE_LIMIT = 128  # buckets: a few key lengths x a few query lengths x layer kinds
_compiled: dict[str, object] = {}


def bucket(n: int) -> int:
    """The padded length for ``n``: the next power of two, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def flex_unavailable(device: torch.device) -> str | None:
    """Why the flex path cannot train on ``device`` (None when it can)."""
    if device.type != "cuda":
        return (
            f"flex_attention has no backward pass on {device.type} in torch {torch.__version__}, and "
            "training needs one"
        )
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    try:
        importlib.import_module("triton")
    except ImportError:
        return "flex_attention compiles to Triton kernels on CUDA and Triton is not installed"
    return None


def resolve_attention(choice: str, device: torch.device) -> str:
    """``train.attention`` -> ``"flex"`` or ``"sdpa"`` for this device (auto = flex on CUDA)."""
    if choice not in ATTENTION_CHOICES:
        raise DflashError(f"train.attention={choice!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "sdpa" or (choice == "auto" and device.type != "cuda"):
        return "sdpa"
    why = flex_unavailable(device)
    if why:
        raise DflashError(
            f'train.attention={choice!r} on {device}: {why}; set train.attention = "sdpa" '
            "(the dense-mask path, slower on GPUs) or install a torch build with Triton"
        )
    return "flex"


def _kernel(q, k, v, block_mask):
    """``flex_attention`` (compiled on CUDA; eager elsewhere: forward only, the scores materialised)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if "flex" not in _compiled:
        import torch._dynamo

        cfg = torch._dynamo.config
        name = (
            "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        )  # renamed in torch 2.6
        setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"](q, k, v, block_mask=block_mask, enable_gqa=True)


class FlexBlocks:
    """The rule as block masks (one per layer kind) over the packed layout; see the module docstring."""

    def __init__(self, pk: Packing, windows: set[int]):
        from torch.nn.attention.flex_attention import create_block_mask

        self.pk = pk
        dev = pk.srt.device
        B = pk.B
        self.T_pad = bucket(pk.T)
        self.A_pad = -(-bucket(pk.A * B) // B)
        self.Q = self.A_pad * B
        self.KV = self.T_pad + self.Q
        self.tok_seq = torch.full((self.T_pad,), -1, dtype=torch.long, device=dev)
        self.tok_seq[: pk.T] = pk.seq_of_tok
        self.anchor = torch.zeros(self.A_pad, dtype=torch.long, device=dev)
        self.anchor[: pk.A] = pk.srt
        self.anchor_seq = torch.full((self.A_pad,), -2, dtype=torch.long, device=dev)  # padding: no sequence
        self.anchor_seq[: pk.A] = pk.a_seq
        self.masks = {
            w: create_block_mask(
                self._mask_mod(w), 1, None, self.Q, self.KV, device=dev, _compile=dev.type == "cuda"
            )
            for w in sorted(windows)
        }

    def _mask_mod(self, window: int):
        B, T_pad = self.pk.B, self.T_pad
        tok_seq, anchor, anchor_seq = self.tok_seq, self.anchor, self.anchor_seq

        def mask_mod(b, h, q_idx, kv_idx):
            qa, qo = q_idx // B, q_idx % B
            kc = kv_idx.clamp(max=T_pad - 1)
            ctx = (
                (kv_idx < T_pad)
                & (tok_seq[kc] == anchor_seq[qa])
                & context_visible(kc, anchor[qa], qo, window)
            )
            kb = kv_idx - T_pad
            blk = (kb >= 0) & (kb // B == qa) & (anchor_seq[qa] >= 0) & block_visible(kb % B, qo, window)
            return ctx | blk

        return mask_mod

    def computed_pairs(self, window: int) -> int:
        """Query-key pairs the kernel computes: every non-empty tile, whole."""
        m = self.masks[window]
        tiles = int(m.kv_num_blocks.sum()) + (
            int(m.full_kv_num_blocks.sum()) if m.full_kv_num_blocks is not None else 0
        )
        return tiles * m.BLOCK_SIZE[0] * m.BLOCK_SIZE[1]

    def __call__(self, q, k_c, v_c, k_b, v_b, window: int) -> torch.Tensor:
        """Same contract as :class:`~dflash_staged.model.block_attention.SdpaBlocks`."""
        pk = self.pk

        def rows(t: torch.Tensor, n: int) -> torch.Tensor:  # [L, heads, hd] -> [1, heads, n, hd], zero padded
            return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]).transpose(0, 1)[None]

        qf = rows(q.flatten(0, 1), self.Q)
        kf = torch.cat([rows(k_c, self.T_pad), rows(k_b.flatten(0, 1), self.Q)], 2)
        vf = torch.cat([rows(v_c, self.T_pad), rows(v_b.flatten(0, 1), self.Q)], 2)
        qf, kf = qf.to(vf.dtype), kf.to(vf.dtype)
        o = _kernel(qf, kf, vf, self.masks[window])  # [1, nh, Q, hd]
        return o[0].transpose(0, 1)[: pk.A * pk.B].unflatten(0, (pk.A, pk.B))
