"""Loading the public reference implementations for the env-gated comparisons (nothing is downloaded:
each points at a local checkout). Only the files compared are executed: the packages' ``__init__``
modules (which pull the rest of each project and its dependencies) and a few leaf helpers of no
bearing on the arithmetic (DeepSpec's metrics logger, its chat parser) are replaced by stand-ins.

Which checkout each variable names, which files of it are read, and the commits the tests were run
against (the newest snapshot of each main branch here, and the pinned commits where main lacks a file):

* ``DSPARK_REFERENCE_DIR``: a checkout of ``deepseek-ai/DeepSpec`` main, :data:`DEEPSPEC_MAIN`
  (``deepspec/modeling/dspark/{common,loss,markov_head}.py``, ``deepspec/modeling/dspark/qwen3/modeling.py``,
  ``deepspec/eval/base_evaluator.py``, ``deepspec/eval/dspark/draft_ops.py``,
  ``deepspec/utils/sampling.py``: :data:`DEEPSPEC_FILES`).
* ``DFLASH_REFERENCE_DIR``: a checkout of ``z-lab/dflash`` (``dflash/model.py``; the variable may also
  name that file, as the older ``DFLASH_REFERENCE_MODEL_PY`` did). Main, :data:`ZLAB_MAIN`, has DFlash
  only: its greedy ``dflash_generate``, no block-causal or sliding-window mask, no rejection-sampled
  decoding, no ``DFlash2DraftModel``. Those are in :data:`ZLAB_DFLASH2`'s ``dflash/model.py``: point
  ``DFLASH2_REFERENCE_DIR`` at a checkout of it (by default the tests look for them in
  ``DFLASH_REFERENCE_DIR``), and each comparison that needs one skips, naming it, where it is missing.
* ``DSPINE_REFERENCE_DIR``: a checkout of ``sgl-project/SpecForge`` with its DSpine files
  (``specforge/modeling/draft/dspine.py`` and ``specforge/algorithms/dspine/model.py``:
  :data:`SPECFORGE_DSPINE`; their DFlash base classes are given by the test). SpecForge's main as of
  :data:`SPECFORGE_MAIN` has no DSpine yet: the tests skip, naming the files and the commits that have
  them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch

DSPARK_REF = os.environ.get("DSPARK_REFERENCE_DIR", "")
DSPINE_REF = os.environ.get("DSPINE_REFERENCE_DIR", "")
DFLASH_REF = os.environ.get("DFLASH_REFERENCE_DIR", "") or os.environ.get("DFLASH_REFERENCE_MODEL_PY", "")
DFLASH2_REF = os.environ.get("DFLASH2_REFERENCE_DIR", "") or DFLASH_REF

DEEPSPEC_MAIN = "deepseek-ai/DeepSpec main afdfa7c9382a3341a3e6f17756dd816da79f132c (2026-06-30)"
ZLAB_MAIN = "z-lab/dflash main 44947fbf71114e241c96de194f4b382b5dd330d0 (2026-04-26)"
ZLAB_DFLASH2 = "z-lab/dflash 07ebd93db9f472af339b644bb70221ad8428328a"
SPECFORGE_MAIN = "sgl-project/SpecForge main a6b6b0230009d15ec2a97a57384e6f53f0f96946 (2026-08-08)"
SPECFORGE_DSPINE = {
    "specforge/modeling/draft/dspine.py": "9aafadfceaeb728209d4b4c6bda221f2c1fed70f",
    "specforge/algorithms/dspine/model.py": "f7bed051d09b605f37f494dfd3640b0487b2536e",
}
DEEPSPEC_FILES = (
    "deepspec/modeling/dspark/common.py",
    "deepspec/modeling/dspark/loss.py",
    "deepspec/modeling/dspark/markov_head.py",
    "deepspec/modeling/dspark/qwen3/modeling.py",
    "deepspec/eval/base_evaluator.py",
    "deepspec/eval/dspark/draft_ops.py",
    "deepspec/utils/sampling.py",
)


def missing(root: str, files) -> list[str]:
    """The ``files`` (paths relative to ``root``) the checkout at ``root`` lacks."""
    return [f for f in files if not (Path(root) / f).is_file()]


def zlab_model_py(ref: str) -> Path:
    """z-lab's ``dflash/model.py`` in the checkout ``ref`` (or ``ref`` itself, when it names the file)."""
    path = Path(ref)
    return path if path.is_file() else path / "dflash" / "model.py"


_ZLAB: dict[Path, types.ModuleType] = {}


def zlab(ref: str) -> types.ModuleType:
    """z-lab's ``dflash/model.py`` from the checkout ``ref``, loaded once (its own module: the tests patch
    its ``_cuda_time``)."""
    path = zlab_model_py(ref)
    if path not in _ZLAB:
        spec = importlib.util.spec_from_file_location(f"dflash_reference_{len(_ZLAB)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _ZLAB[path] = mod
    return _ZLAB[path]


# what each comparison needs of z-lab's dflash/model.py beside main's DFlash, and how it is detected
ZLAB_FEATURES = {
    "dflash2": ("DFlash2DraftModel", "the DFlash2 drafter"),
    "masks": (
        "_attention_mask",
        "block-causal and sliding-window draft masks (config is_causal, layer_types)",
    ),
    "sampling": ("_rejection_sample", "rejection-sampled decoding with top-p / top-k"),
}


def zlab_lacks(ref: str, *features: str) -> str | None:
    """Why the checkout ``ref`` cannot run a comparison that needs ``features`` (None: it can)."""
    path = zlab_model_py(ref)
    if not path.is_file():
        return f"{ref} has no dflash/model.py (a checkout of z-lab/dflash: {ZLAB_MAIN} or {ZLAB_DFLASH2})"
    mod = zlab(ref)
    gone = [
        f"{ZLAB_FEATURES[f][0]} ({ZLAB_FEATURES[f][1]})"
        for f in features
        if not hasattr(mod, ZLAB_FEATURES[f][0])
    ]
    if not gone:
        return None
    return (
        f"{path} lacks {', '.join(gone)}: {ZLAB_MAIN} has none of them; point DFLASH2_REFERENCE_DIR at a "
        f"checkout of {ZLAB_DFLASH2} (its dflash/model.py)"
    )


def legacy_crop(monkeypatch) -> None:
    """DeepSpec and z-lab's main call ``DynamicCache.crop(n)`` to keep ``n`` tokens (transformers 4.x);
    this transformers takes a negative count of tokens to remove: translate positive counts."""
    from transformers import DynamicCache

    crop = DynamicCache.crop

    def keep(self, n):
        if n > 0:  # (0 is ambiguous: removing none, as 07ebd93's z-lab file means it, is left alone)
            n = -(self.get_seq_length() - n)
            if n == 0:
                return
        crop(self, n)

    monkeypatch.setattr(DynamicCache, "crop", keep)


def dense_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, **_):
    """``create_block_mask``'s role for SDPA: the reference's own ``mask_mod`` evaluated on every
    (query, key) pair -> a boolean ``[B, 1, Q_LEN, KV_LEN]`` mask (True = attend)."""
    b = torch.arange(B, device=device)[:, None, None]
    q = torch.arange(Q_LEN, device=device)[None, :, None]
    kv = torch.arange(KV_LEN, device=device)[None, None, :]
    return mask_mod(b, None, q, kv).expand(B, Q_LEN, KV_LEN)[:, None]


def _package(name: str, path: Path | None = None) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = [str(path)] if path is not None else []
    sys.modules[name] = m
    return m


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def deepspec() -> types.SimpleNamespace:
    """DeepSpec's DSpark modeling, loss and evaluation loop, from ``DSPARK_REFERENCE_DIR``."""
    root = Path(DSPARK_REF)
    for k in [k for k in sys.modules if k == "deepspec" or k.startswith("deepspec.")]:
        del sys.modules[k]
    for pkg in (
        "deepspec",
        "deepspec.modeling",
        "deepspec.modeling.dspark",
        "deepspec.eval",
        "deepspec.data",
    ):
        _package(pkg, root / pkg.replace(".", "/"))
    _package("deepspec.eval.dspark", root / "deepspec/eval/dspark")
    noop = lambda *a, **k: None  # noqa: E731
    _package("deepspec.utils", root / "deepspec/utils").__dict__.update(
        init_dist=noop, seed_all=noop, jsonable=noop
    )
    _module("deepspec.utils.metrics", add_metric=noop)
    _module("deepspec.data.parser", encode_chat_messages=noop)
    sampling = importlib.import_module("deepspec.utils.sampling")
    common = importlib.import_module("deepspec.modeling.dspark.common")
    qwen3 = _package("deepspec.modeling.dspark.qwen3", root / "deepspec/modeling/dspark/qwen3")
    modeling = importlib.import_module("deepspec.modeling.dspark.qwen3.modeling")
    qwen3.Qwen3DSparkModel = modeling.Qwen3DSparkModel
    _package("deepspec.modeling.dspark.gemma4").Gemma4DSparkModel = type("Gemma4DSparkModel", (), {})
    loss = importlib.import_module("deepspec.modeling.dspark.loss")
    base = importlib.import_module("deepspec.eval.base_evaluator")
    ops = importlib.import_module("deepspec.eval.dspark.draft_ops")
    return types.SimpleNamespace(
        sampling=sampling, common=common, modeling=modeling, loss=loss, base=base, ops=ops
    )


def specforge(dflash_base, online_base, mask_builder) -> types.SimpleNamespace:
    """SpecForge's DSpine draft model and training model, from ``DSPINE_REFERENCE_DIR``, over the DFlash
    base classes and mask builder the caller gives (SpecForge's own pull in its whole runtime)."""
    root = Path(DSPINE_REF)
    for k in [k for k in sys.modules if k == "specforge" or k.startswith("specforge.")]:
        del sys.modules[k]
    for pkg in (
        "specforge",
        "specforge.modeling",
        "specforge.modeling.draft",
        "specforge.algorithms",
        "specforge.algorithms.common",
        "specforge.algorithms.dspine",
        "specforge.core",
    ):
        _package(pkg, root / pkg.replace(".", "/"))
    _module("specforge.modeling.draft.dflash", DFlashDraftModel=dflash_base)
    _module("specforge.modeling.draft.registry", register_draft=lambda cls: cls)
    _module(
        "specforge.algorithms.common.dflash_family_model",
        OnlineDFlashModel=online_base,
        create_dflash_block_mask=mask_builder,
        create_dflash_sdpa_mask=mask_builder,
    )

    def checkpointed_chunk_reduce(function, *aligned, chunk_size, dim=0):  # the whole dimension at once
        return function(*aligned)

    _module("specforge.core.chunking", checkpointed_chunk_reduce=checkpointed_chunk_reduce)
    draft = _load("specforge.modeling.draft.dspine", root / "specforge/modeling/draft/dspine.py")
    model = _load("specforge.algorithms.dspine.model", root / "specforge/algorithms/dspine/model.py")
    return types.SimpleNamespace(draft=draft, model=model)


def deepspec_lacks() -> str | None:
    """Why ``DSPARK_REFERENCE_DIR`` cannot run the DSpark comparisons (None: it can)."""
    gone = missing(DSPARK_REF, DEEPSPEC_FILES)
    return f"{DSPARK_REF} lacks {', '.join(gone)} (a checkout of {DEEPSPEC_MAIN})" if gone else None


def specforge_lacks() -> str | None:
    """Why ``DSPINE_REFERENCE_DIR`` cannot run the DSpine comparisons (None: it can)."""
    gone = missing(DSPINE_REF, SPECFORGE_DSPINE)
    if not gone:
        return None
    at = ", ".join(f"{f} (SpecForge {SPECFORGE_DSPINE[f]})" for f in gone)
    return f"{DSPINE_REF} lacks {at}: {SPECFORGE_MAIN} has no DSpine"
