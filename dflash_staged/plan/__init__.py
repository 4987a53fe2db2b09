"""``dflash plan``: read the data (JSONL: token ids or conversations), bucket it by length, cut token-budget batches, and write one shuffled job list per epoch into the manifest."""
