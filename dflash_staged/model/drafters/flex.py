"""The DFlash rule as a ``flex_attention`` block mask: the block-sparse training path (default on CUDA).

* **Layout.** One row of queries, every anchor's block (anchors sorted, ``B`` queries each),
  against one row of keys: the packed context of every sequence, then the blocks. The
  ``mask_mod`` is :mod:`dflash_staged.model.drafters.attention`'s rule plus "same sequence";
  padding sees nothing and is seen by nothing. ``flex_attention`` skips every 128x128 tile
  the mask leaves empty, so the work follows what each anchor can see (context before it,
  its own block) instead of the padded whole.
* **GQA** with ``enable_gqa=True``: K/V are never repeated.
* **Compiled once per shape bucket, a bounded number of times.** ``torch.compile`` builds
  ``flex_attention`` and the mask once per (context bucket, query bucket, layer kind) and never
  per step (:func:`padded_shape`): the context is padded to a power of two (at least 128), the
  block rows likewise, and to at least the padded context / 2**:data:`QUERY_SPAN`, so each
  context bucket has at most ``QUERY_SPAN + ceil(log2(block)) + 1`` query buckets (anchors are context
  tokens: rows <= context x block). Contexts up to :data:`MAX_CONTEXT` tokens then give at most
  :func:`shape_bound` shapes per layer kind, and Dynamo's recompile limits (per code object, all
  kinds together) are raised to :data:`RECOMPILE_LIMIT`, above that bound for two layer kinds,
  and past twice the shapes seen (a shape called with and without grad is two entries) when
  more come, so Dynamo never falls back to eager
  ``flex_attention`` (which materialises the whole score matrix and runs out of memory). Each new
  shape is logged once, on stderr, when it is first compiled. Padding costs memory, not compute
  (its tiles are empty).
* **Where.** CUDA with Triton. ``flex_attention`` has no backward pass on CPU in the torch
  versions this package supports, so training there uses the SDPA path and
  ``train.attention = "flex"`` is an error (:func:`resolve_attention`).
"""

from __future__ import annotations

import importlib
import sys
import warnings

import torch

from dflash_staged.config import ATTENTION_CHOICES
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.attention import Packing, block_visible, context_visible

MIN_BUCKET = 128
QUERY_SPAN = 4  # block rows are padded to at least the padded context / 2**QUERY_SPAN
MAX_CONTEXT = 1 << 17  # the context lengths (tokens per microbatch) the shape bound is stated for
RECOMPILE_LIMIT = 256  # >= 2 layer kinds x shape_bound(MAX_CONTEXT, 16)
_compiled: dict[str, object] = {}
_shapes: set[tuple[int, int, int, tuple[int, bool]]] = set()  # (padded context, query rows, block, kind)


def bucket(n: int) -> int:
    """The padded length for ``n``: the next power of two, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def padded_shape(T: int, A: int, B: int) -> tuple[int, int]:
    """(padded context, padded anchors) for ``T`` context tokens and ``A`` anchors of ``B`` rows."""
    T_pad = bucket(T)
    rows = max(bucket(A * B), T_pad >> QUERY_SPAN)
    return T_pad, -(-rows // B)


def shape_bound(max_context: int, B: int) -> int:
    """Most distinct :func:`padded_shape` results per layer kind for contexts up to ``max_context``
    and up to one anchor per context token."""
    contexts = bucket(max_context).bit_length() - MIN_BUCKET.bit_length() + 1
    return contexts * (QUERY_SPAN + (B - 1).bit_length() + 1)


def _raise_recompile_limits(n: int) -> None:
    """Let Dynamo keep ``n`` compiled entries per code object (both limits; named so since torch 2.6)."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for new, old in (
        ("recompile_limit", "cache_size_limit"),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
    ):
        name = new if hasattr(cfg, new) else old
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))


def note_shape(T_pad: int, Q: int, B: int, kind: tuple[int, bool]) -> bool:
    """Record a shape about to be compiled; log it and return True the first time only."""
    window, causal = kind
    key = (T_pad, Q, B, kind)
    if key in _shapes:
        return False
    _shapes.add(key)
    # grad and no-grad calls of one shape are two entries: keep twice the shapes, and a margin
    _raise_recompile_limits(max(RECOMPILE_LIMIT, 2 * len(_shapes) + 8))
    print(
        f"flex_attention: compiling shape {len(_shapes)}: context {T_pad}, {Q} block rows "
        f"(block {B}), window {window or 'full'}{', causal' if causal else ''}",
        file=sys.stderr,
        flush=True,
    )
    return True


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
        _raise_recompile_limits(RECOMPILE_LIMIT)
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"](q, k, v, block_mask=block_mask, enable_gqa=True)


class FlexBlocks:
    """The rule as block masks (one per layer kind) over the packed layout; see the module docstring."""

    def __init__(self, pk: Packing, kinds: set[tuple[int, bool]]):
        from torch.nn.attention.flex_attention import create_block_mask

        self.pk = pk
        dev = pk.srt.device
        B = pk.B
        self.T_pad, self.A_pad = padded_shape(pk.T, pk.A, B)
        self.Q = self.A_pad * B
        self.KV = self.T_pad + self.Q
        self.tok_seq = torch.full((self.T_pad,), -1, dtype=torch.long, device=dev)
        self.tok_seq[: pk.T] = pk.seq_of_tok
        self.anchor = torch.zeros(self.A_pad, dtype=torch.long, device=dev)
        self.anchor[: pk.A] = pk.srt
        self.anchor_seq = torch.full((self.A_pad,), -2, dtype=torch.long, device=dev)  # padding: no sequence
        self.anchor_seq[: pk.A] = pk.a_seq
        if dev.type == "cuda":  # compiled there (mask and kernel): one log line per new shape
            for kind in kinds:
                note_shape(self.T_pad, self.Q, B, kind)
        self.masks = {
            kind: create_block_mask(
                self._mask_mod(kind), 1, None, self.Q, self.KV, device=dev, _compile=dev.type == "cuda"
            )
            for kind in sorted(kinds)
        }

    def _mask_mod(self, kind: tuple[int, bool]):
        B, T_pad = self.pk.B, self.T_pad
        window, causal = kind
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
            blk = (
                (kb >= 0)
                & (kb // B == qa)
                & (anchor_seq[qa] >= 0)
                & block_visible(kb % B, qo, window, causal)
            )
            return ctx | blk

        return mask_mod

    def computed_pairs(self, kind: tuple[int, bool]) -> int:
        """Query-key pairs the kernel computes: every non-empty tile, whole."""
        m = self.masks[kind]
        tiles = int(m.kv_num_blocks.sum()) + (
            int(m.full_kv_num_blocks.sum()) if m.full_kv_num_blocks is not None else 0
        )
        return tiles * m.BLOCK_SIZE[0] * m.BLOCK_SIZE[1]

    def __call__(self, q, k_c, v_c, k_b, v_b, kind: tuple[int, bool]) -> torch.Tensor:
        """Same contract as :class:`~dflash_staged.model.drafters.attention.SdpaBlocks`."""
        pk = self.pk

        def rows(t: torch.Tensor, n: int) -> torch.Tensor:  # [L, heads, hd] -> [1, heads, n, hd], zero padded
            return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])]).transpose(0, 1)[None]

        qf = rows(q.flatten(0, 1), self.Q)
        kf = torch.cat([rows(k_c, self.T_pad), rows(k_b.flatten(0, 1), self.Q)], 2)
        vf = torch.cat([rows(v_c, self.T_pad), rows(v_b.flatten(0, 1), self.Q)], 2)
        qf, kf = qf.to(vf.dtype), kf.to(vf.dtype)
        o = _kernel(qf, kf, vf, self.masks[kind])  # [1, nh, Q, hd]
        return o[0].transpose(0, 1)[: pk.A * pk.B].unflatten(0, (pk.A, pk.B))
