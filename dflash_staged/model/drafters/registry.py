"""The drafter families, by ``[drafter] architecture``: one line each (see
:mod:`dflash_staged.model.drafters.family` for what a family supplies)."""

from __future__ import annotations

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters import dflash, dflash2, dspark, dspine
from dflash_staged.model.drafters.family import Family

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        dflash.FAMILY,
        dflash2.FAMILY,
        dspark.FAMILY,
        dspine.FAMILY,
    )
}


def family(name: str) -> Family:
    """The family named ``name`` (``[drafter] architecture``), or one line listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise DflashError(
            f"drafter.architecture={name!r}: use one of {', '.join(repr(n) for n in FAMILIES)}"
        ) from None


def family_of(architectures, source: str) -> Family:
    """The family whose ``config.json`` name is in ``architectures``, or one line saying it is none."""
    archs = list(architectures or [])
    for f in FAMILIES.values():
        if any(a in (f.architecture, *f.also_reads) for a in archs):
            return f
    names = ", ".join(f'["{f.architecture}"]' for f in FAMILIES.values())
    raise DflashError(
        f"{source}: architectures={archs} is not a drafter this project trains; expected {names}"
    )
