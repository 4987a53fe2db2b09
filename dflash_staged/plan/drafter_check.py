"""``dflash plan`` checks the whole drafter before it writes anything: the drafter config a run will build
(every family option against the target's dimensions), what every serving engine would mis-serve, and
whether the store the plan asks for holds the target's distribution the family or the loss needs. A
refusal is one line naming the config file and the settings; a default the family scaled down to fit this
target is said, not refused. The trainer repeats the checks against the store it finds (a store planned
by an older version), through the same functions (:mod:`dflash_staged.model.run_drafter`).
"""

from __future__ import annotations

from dflash_staged.config import ConfigError
from dflash_staged.errors import DflashError


def check_drafter(cfg, config_path, dims, layer_ids: list[int]) -> list[str]:
    """Refuse (``ConfigError``, one line starting with ``config_path``) a drafter that would fail after
    extraction; return the notes to print (defaults scaled to fit)."""
    from dflash_staged.model.drafters.engines import check_servable
    from dflash_staged.model.drafters.weights import validate_mask_token
    from dflash_staged.model.run_drafter import distribution_problem, fitted_options, run_drafter_config
    from dflash_staged.model.target import load_tokenizer

    try:
        mask_id = validate_mask_token(cfg.drafter.mask_token_id, load_tokenizer(cfg.target), dims.vocab_size)
        dcfg = run_drafter_config(cfg, dims, layer_ids, mask_id)
        check_servable(dcfg)
    except ConfigError:
        raise
    except DflashError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    t = cfg.target
    why = distribution_problem(
        cfg, t.store_last_layer, t.store_topk, "the config stores neither", "set {slices}"
    )
    if why:
        raise ConfigError(f"{config_path}: {why}")
    if dcfg.family.needs_target and t.store_topk and not t.store_last_layer and t.topk_temperature != 1.0:
        raise ConfigError(
            f"{config_path}: drafter.architecture = {dcfg.family.name!r} learns the target's distribution at "
            f"temperature 1, and [target] topk_temperature = {t.topk_temperature:g}: set it to 1.0"
        )
    terms = cfg.train.target_terms
    if terms and t.store_topk and not t.store_last_layer:
        if cfg.train.distill_temperature != t.topk_temperature:
            raise ConfigError(
                f"{config_path}: train.distill_temperature = {cfg.train.distill_temperature:g}, but the "
                f"store keeps the target's top-{t.store_topk} at [target] topk_temperature = "
                f"{t.topk_temperature:g}: set one to the other"
            )
    if cfg.train.target_topk > t.store_topk:
        raise ConfigError(
            f"{config_path}: train.target_topk = {cfg.train.target_topk}, but [target] store_topk = "
            f"{t.store_topk}: set train.target_topk to at most {t.store_topk} (0 = all stored)"
        )
    return fitted_options(cfg, dcfg)
