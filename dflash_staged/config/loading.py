"""Loading a config: a TOML file (or a snapshot's dict) checked against the schema.

Unknown sections and keys and wrong types are refused with a :class:`ConfigError` naming the file,
the key and the expected type; the values are then checked by the section's dataclass
(:mod:`.schema`). A key left out takes its default, so a manifest's snapshot made before a field
existed loads with that field's default.
"""

from __future__ import annotations

import json
import math
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from dflash_staged.config.schema import _SECTION_CLASSES, Config, ConfigError, TargetConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "table"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against annotation `tp`; return it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return [_coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # a table of JSON values (it is snapshotted as JSON)
        if not isinstance(value, dict):
            raise ConfigError(
                f"{where}: expected a table, e.g. {{ key = value }}, got {type(value).__name__} {value!r}"
            )
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}; use strings, numbers, booleans, arrays and tables") from None
        return value
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                f = float(value)
            except OverflowError:  # an integer beyond float range
                f = math.inf
            if not math.isfinite(f):
                raise ConfigError(f"{where}: {str(value)[:40]} is not a finite number; give a finite value")
            value = f
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover
        ok = True
    if not ok:
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is int and abs(value) > 2**62:
        raise ConfigError(f"{where}: {str(value)[:40]} is out of range; use a value below 2**62")
    return value


def _build_section(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table [{where.rsplit(' ', 1)[-1]}], got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key; known keys are: {', '.join(sorted(known))}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where.split(':')[0]}: {e}") from None


def config_from_dict(raw: dict[str, Any], source: str = "<config>") -> Config:
    for key in raw:
        if key not in _SECTION_CLASSES:
            raise ConfigError(
                f"{source}: unknown section [{key}]; known sections are: {', '.join(_SECTION_CLASSES)}"
            )
    parts = {
        name: _build_section(cls, raw.get(name, {}), f"{source}: {name}")
        for name, cls in _SECTION_CLASSES.items()
    }
    return Config(**parts)


def load_config(path: str | Path) -> Config:
    """Load and validate a TOML config; errors name the file, key and expected type."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror}); check the path") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: byte {e.start} is not UTF-8; save the file as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}; fix the syntax") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: invalid TOML: arrays or tables nested too deeply; fix the syntax"
        ) from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise ConfigError(f"{path}: invalid TOML: {e}; fix the value") from None
    return config_from_dict(raw, str(path))


def target_from_spec(spec: str) -> TargetConfig:
    """``--target``: a dflash config TOML (its ``[target]``), or a model directory, hub id or ``tiny:*``."""
    if spec.endswith(".toml"):
        return load_config(spec).target
    return TargetConfig(model=spec)
