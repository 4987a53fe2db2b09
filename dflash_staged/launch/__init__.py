"""``dflash pipeline`` and ``dflash node``: plan, then extract and train side by side under one supervisor."""
