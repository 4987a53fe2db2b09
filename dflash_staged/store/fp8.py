"""Hidden states in FP8 (``[extract] store_dtype = "float8_e4m3fn"``): e4m3 values with one float32
scale per token and stored layer, as vLLM's speculators stores them.

Contract:

* :func:`quantize` maps ``hidden [T, K, H]`` (any float dtype, any device) to ``(q, scale)``:
  ``scale[t, k] = max_h |hidden[t, k, h]| / 448`` (float32; 448 is e4m3's largest finite value) and
  ``q = hidden / scale`` rounded to the nearest e4m3 value, saturating at +-448. A row of zeros
  has scale 0 and reads back as zeros, exactly. A non-finite value raises ``ValueError`` (extract
  screens its states before this, so none should reach it).
* :func:`dequantize` gives ``q x scale`` in the dtype asked for. Each element's error is at most
  half an e4m3 step at its magnitude: ``|x - x^| <= scale x max(|x / scale| x 2^-4, 2^-10)``
  (3 mantissa bits; below 2^-6 the subnormal step 2^-9 holds), whatever the row's magnitude.
* On disk ``q`` is a ``uint8`` array holding the e4m3 bit patterns (zarr 3.1 has no float8), and
  ``scale`` is the shard's ``hidden_scale`` array ``[T, K]`` (:mod:`dflash_staged.store.shard_store`).
"""

from __future__ import annotations

import torch

from dflash_staged.dtypes import STORE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4  # one float32 scale per token and stored layer


__all__ = ["FP8", "FP8_MAX", "SCALE_BYTES", "STORE_DTYPES", "dequantize", "quantize"]


def quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, K, H] float8_e4m3fn, scale [T, K] float32)`` on ``hidden``'s device."""
    x = hidden.float()
    amax = x.abs().amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    if x.numel() and not bool(torch.isfinite(amax).all()):
        raise ValueError("hidden states hold an inf or a NaN: they cannot be stored in FP8")
    scale = amax / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q x scale`` as ``dtype``, on ``q``'s device (the trainer's: the copy there is one byte a value)."""
    return (q.float() * scale.to(q.device, torch.float32)[..., None]).to(dtype)
