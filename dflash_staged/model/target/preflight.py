"""Kernel preflight for hybrid linear-attention targets (Qwen3.5, Qwen3-Next).

transformers runs the gated-delta-rule and causal-conv1d layers of a hybrid
target with the fast kernels of ``flash-linear-attention`` (import name ``fla``)
and ``causal-conv1d`` when they import, and otherwise silently falls back to
pure PyTorch, function by function (transformers 5 resolves each kernel on its own).
The gated-delta-rule fallback is a correct but far slower reference: on CUDA it
would waste the GPU, so :func:`preflight_kernels` refuses to start a hybrid target
without a working ``fla`` (:class:`KernelPreflightError`) unless the user allows
slow kernels. The causal-conv1d fallback is one depthwise ``F.conv1d``, cheap next
to the rest of the layer, so a missing or broken ``causal-conv1d`` is only a
warning. On CPU the reference path is the only one (the kernels need CUDA, and
triton on a CPU-only machine breaks transformers' forward), so it is used and
logged once.
"""

from __future__ import annotations

import importlib
import logging

import torch

from dflash_staged.errors import DflashError

log = logging.getLogger(__name__)

HYBRID_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
# (import name, pip distribution, attributes the model needs, required: whether its absence refuses)
_KERNELS = (
    (
        "fla",
        "flash-linear-attention",
        (
            "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
            "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
        ),
        True,
    ),
    (
        "causal_conv1d",
        "causal-conv1d",
        ("causal_conv1d.causal_conv1d_fn", "causal_conv1d.causal_conv1d_update"),
        False,
    ),
)
_cpu_logged = False


class KernelPreflightError(DflashError):
    """A hybrid target would run on CUDA without its fast kernels."""


def is_hybrid_config(model_config) -> bool:
    """True when a transformers config describes a model with linear-attention layers."""
    configs = [model_config]
    get_text = getattr(model_config, "get_text_config", None)
    if get_text is not None:
        configs.append(get_text())
    for c in configs:
        if getattr(c, "model_type", None) in HYBRID_MODEL_TYPES:
            return True
        if "linear_attention" in (getattr(c, "layer_types", None) or ()):
            return True
    return False


def _resolve(path: str):
    module_name, attr = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), attr)


def _smoke(package: str, fns: dict, device: torch.device) -> None:
    """Run each kernel once on a small bf16 input, the way transformers calls it."""
    dt = torch.bfloat16
    if package == "causal_conv1d":
        x = torch.randn(1, 64, 16, device=device, dtype=dt)
        w = torch.randn(64, 4, device=device, dtype=dt)
        fns["causal_conv1d_fn"](x, w, None, activation="silu")
    else:
        q, k, v = (torch.randn(1, 64, 2, 64, device=device, dtype=dt) for _ in range(3))
        g = -torch.rand(1, 64, 2, device=device, dtype=torch.float32)
        beta = torch.rand(1, 64, 2, device=device, dtype=dt)
        fns["chunk_gated_delta_rule"](
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
    torch.cuda.synchronize(device)


def _kernel_problems(device: torch.device) -> tuple[list[str], list[str]]:
    """(problems of the required kernels, problems of the optional ones)."""
    required, optional = [], []
    for package, dist, paths, needed in _KERNELS:
        problems = required if needed else optional
        try:
            fns = {p.rsplit(".", 1)[1]: _resolve(p) for p in paths}
        except Exception as e:  # ImportError, AttributeError, or a broken triton/CUDA build
            problems.append(f"{dist} (import {package!r} failed: {type(e).__name__}: {e})")
            continue
        try:
            _smoke(package, fns, device)
        except Exception as e:
            problems.append(f"{dist} (imported but its kernel failed on {device}: {type(e).__name__}: {e})")
    return required, optional


def preflight_kernels(model_config, device, allow_slow: bool = False) -> None:
    """Check that a hybrid target has its fast kernels on CUDA; see the module docstring.

    Dense targets always pass. On CUDA, a hybrid target without an importable and
    working ``fla`` raises :class:`KernelPreflightError`, or logs a warning when
    ``allow_slow`` is set; without a working ``causal_conv1d`` it logs a warning. On
    CPU it logs once that the reference fallbacks are in use.
    """
    global _cpu_logged
    if not is_hybrid_config(model_config):
        return
    device = torch.device(device)
    if device.type != "cuda":
        if not _cpu_logged:
            log.warning(
                "hybrid target on %s: using transformers' PyTorch reference fallbacks for the "
                "linear-attention layers (correct, slow; the fast kernels need CUDA)",
                device.type,
            )
            _cpu_logged = True
        return
    problems, optional = _kernel_problems(device)
    if optional:
        log.warning(
            "hybrid target on %s without the causal-conv1d kernel: %s. transformers uses its PyTorch "
            "depthwise conv1d instead (correct, a small cost next to the rest of the layer); "
            "pip install 'dflash-staged[cuda]' for the fused kernel",
            device,
            "; ".join(optional),
        )
    if not problems:
        return
    what = "; ".join(problems)
    if allow_slow:
        log.warning(
            "hybrid target on %s without fast kernels: %s. Running on the slow PyTorch reference "
            "path because slow kernels are allowed.",
            device,
            what,
        )
        return
    raise KernelPreflightError(
        f"hybrid (linear-attention) target on {device} needs fast kernels, but these are missing or "
        f"unusable: {what}. Install them with: pip install 'dflash-staged[cuda]' — or pass "
        f"--allow-slow-kernels (target.allow_slow_kernels = true) to run on the much slower PyTorch "
        "reference path"
    )
