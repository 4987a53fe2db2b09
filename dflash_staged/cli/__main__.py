"""``python -m dflash_staged.cli``: the same as ``dflash`` (and ``python -m dflash_staged``)."""

from dflash_staged.cli import main

main()
