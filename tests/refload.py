"""Loading the public reference implementations for the env-gated comparisons (nothing is downloaded:
each points at a local checkout). Only the files compared are executed: the packages' ``__init__``
modules (which pull the rest of each project and its dependencies) and a few leaf helpers of no
bearing on the arithmetic (DeepSpec's metrics logger, its chat parser) are replaced by stand-ins.

* ``DSPARK_REFERENCE_DIR``: a checkout of ``deepseek-ai/DeepSpec`` (``deepspec/modeling/dspark/``,
  ``deepspec/eval/``, ``deepspec/utils/sampling.py`` are read).
* ``DSPINE_REFERENCE_DIR``: a checkout of ``sgl-project/SpecForge``
  (``specforge/modeling/draft/dspine.py`` and ``specforge/algorithms/dspine/model.py`` are read; their
  DFlash base classes are given by the test, see ``tests/test_family_reference.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

DSPARK_REF = os.environ.get("DSPARK_REFERENCE_DIR", "")
DSPINE_REF = os.environ.get("DSPINE_REFERENCE_DIR", "")


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
