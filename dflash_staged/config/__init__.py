"""Configuration: TOML files under ``configs/`` loaded into self-validating dataclasses.

A config has five sections, each a dataclass of :mod:`.schema` (where every field's meaning and
default is written): ``[target]``, ``[data]``, ``[drafter]``, ``[train]`` and ``[extract]``.
:mod:`.loading` reads a file or a snapshot and rejects unknown keys and wrong types with a
:class:`ConfigError` naming the file, the key and the expected type; each dataclass's
``__post_init__`` checks values and names the fix. :mod:`.overrides` applies ``train --set``.

``dflash plan`` snapshots the resolved config into the manifest; ``extract`` and ``train`` read it
back from there (see :mod:`dflash_staged.manifest`), so both sides always agree. A few settings
can be overridden on their own command lines (``extract --window`` / ``--window-bytes`` /
``--dtype`` / ``--allow-slow-kernels``); :data:`REPLAY_OVERRIDABLE` lists what ``train --set``
may change.
"""

from dflash_staged.config.loading import config_from_dict, load_config, target_from_spec, tomllib
from dflash_staged.config.overrides import REPLAY_OVERRIDABLE, apply_overrides
from dflash_staged.config.schema import (
    _SECTION_CLASSES,
    ATTENTION_CHOICES,
    FULL,
    LAYER_TYPES,
    LOSS_TERMS,
    RENDER_ARGS,
    SECTIONS,
    SLIDING,
    TARGET_TERMS,
    Config,
    ConfigError,
    DataConfig,
    DrafterConfig,
    ExtractConfig,
    TargetConfig,
    TrainConfig,
    check_layer_types,
    dflash_target_layers,
)

__all__ = [
    "ATTENTION_CHOICES",
    "FULL",
    "LOSS_TERMS",
    "TARGET_TERMS",
    "LAYER_TYPES",
    "RENDER_ARGS",
    "REPLAY_OVERRIDABLE",
    "SECTIONS",
    "SLIDING",
    "_SECTION_CLASSES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "ExtractConfig",
    "TargetConfig",
    "TrainConfig",
    "apply_overrides",
    "check_layer_types",
    "config_from_dict",
    "dflash_target_layers",
    "load_config",
    "target_from_spec",
    "tomllib",
]
