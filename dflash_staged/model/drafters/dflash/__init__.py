"""DFlash (z-lab's ``DFlashDraftModel``): the shared backbone alone, the anchor row first and rows
1..B-1 the proposals; its objective is :mod:`dflash_staged.train.objective`'s and its drafts the
block's argmax (or a sample from its logits)."""

from dflash_staged.model.drafters.family import Family

FAMILY = Family(name="dflash", architecture="DFlashDraftModel")
