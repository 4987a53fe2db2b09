"""Floating-point dtype names as configs, checkpoints and the store spell them, and their torch dtypes.

The one place the mapping lives: ``target.dtype`` and ``drafter.dtype`` (config), the
``dtype`` of a drafter's ``config.json``, and the store's ``logical_dtype`` all use these names.
"""

from __future__ import annotations

import torch

from dflash_staged.errors import DflashError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# [extract] store_dtype: the shards' hidden states in the target's dtype, or FP8 (dflash_staged.store.fp8)
STORE_DTYPES = ("target", "float8_e4m3fn")


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error naming ``what`` for anything else."""
    try:
        return DTYPES[name]
    except KeyError:
        raise DflashError(f"{what}={name!r}: use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise DflashError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")


def resolve_dtype(name: str, device, what: str = "target.dtype") -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere; other names map directly."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch_dtype(name, what)
