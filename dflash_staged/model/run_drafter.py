"""The drafter a run trains, decided from the config and the target's facts alone (no weights): its
:class:`~dflash_staged.model.drafters.config.DraftModelConfig` (:func:`run_drafter_config`), the options
a family scaled to fit this target (:func:`fitted_options`), and whether the store holds the target's
distribution the family or the loss needs, at a temperature they can use (:func:`store_problem`).

``dflash plan`` calls these before it writes anything, and the trainer builds its drafter from the same
:func:`run_drafter_config`, so a drafter that plans is one that builds.
"""

from __future__ import annotations

import copy

from dflash_staged.model.drafters.config import DraftModelConfig
from dflash_staged.model.drafters.registry import family


def run_drafter_config(cfg, dims, layer_ids: list[int], mask_id: int) -> DraftModelConfig:
    """The drafter config of a run of ``cfg`` on a target of ``dims`` (``TargetDims``), tapping
    ``layer_ids``, with the resolved ``mask_id``. A drafter initialised from the target (``drafter.init``
    other than random) with ``intermediate_size = 0`` takes the target's MLP width, so its layers can be
    copied. Raises ``DflashError`` naming the setting a value does not fit."""
    if cfg.drafter.init != "random" and not cfg.drafter.intermediate_size:
        from dflash_staged.model.target.dims import target_text_config

        cfg = copy.deepcopy(cfg)
        cfg.drafter.intermediate_size = int(
            getattr(target_text_config(cfg.target), "intermediate_size", 0) or 0
        )
    return DraftModelConfig.from_config(
        cfg, dims.hidden_size, dims.vocab_size, dims.num_layers, list(layer_ids), mask_id
    )


def fitted_options(cfg, dcfg: DraftModelConfig) -> list[str]:
    """One line for each family option the config left at its default and the family scaled down to fit
    this target (e.g. DSpine's ``transfer_rank`` 1024 on a 128-wide target)."""
    given = set(cfg.drafter.options or {})
    defaults = dcfg.family.defaults
    return [
        f"drafter.options.{k}: the default {defaults[k]!r} does not fit this target; using {v!r} (set it to "
        "keep another value)"
        for k, v in dcfg.options.items()
        if k not in given and k in defaults and v != defaults[k]
    ]


def store_problem(
    cfg, last_layer: bool, topk: int, topk_temperature: float, where: str, fix: str
) -> str | None:
    """Why training ``cfg`` cannot use a store holding the target's last layer (``last_layer``) and its
    top-``topk`` (0 = none) at ``topk_temperature``, or None. ``where`` names the store or config ("store X
    was extracted with", "the config sets"), ``fix`` how to change it ("plan with {what} and extract
    again", "set {what}"; ``{what}`` is filled in)."""
    fam, t = family(cfg.drafter.architecture), cfg.train
    if t.target_topk > topk:
        held = f"its top-{topk}" if topk else "no top-k (its last layer serves the terms)"
        return (
            f"train.target_topk = {t.target_topk}, but {where} {held}: set train.target_topk to at most "
            f"{topk} (0 = all stored), or " + fix.format(what=f"[target] store_topk = {t.target_topk}")
        )
    if last_layer:
        return None
    if topk:
        if fam.needs_target and topk_temperature != 1.0:
            return (
                f"drafter.architecture = {fam.name!r} learns the target's distribution at temperature 1, and "
                f"{where} its top-{topk} at [target] topk_temperature = {topk_temperature:g}: "
                + fix.format(what="topk_temperature = 1.0")
            )
        if t.target_terms and t.distill_temperature != topk_temperature:
            return (
                f"train.distill_temperature = {t.distill_temperature:g}, but {where} the target's top-{topk} "
                f"at [target] topk_temperature = {topk_temperature:g}: set train.distill_temperature = "
                f"{topk_temperature:g}"
            )
        return None
    slices = "[target] store_last_layer = true or [target] store_topk = 64"
    if fam.needs_target:
        return (
            f"drafter.architecture = {fam.name!r} learns from the target's own distribution, which needs "
            f"its last layer or its top-k in the store, and {where} neither: {fix.format(what=slices)}"
        )
    if t.needs_target:
        what = ", ".join(t.target_terms) or "selector_labels = target"
        return (
            f"train.loss = {t.loss} ({what}) learns the target's own distribution, which needs its last "
            f"layer or its top-k in the store, and {where} neither: {fix.format(what=slices)}, or train "
            "with loss = { ce = 1.0 }"
        )
    return None
