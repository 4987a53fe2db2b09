"""``dflash plan``: read the data, bucket it by length, cut token-budget batches, and write one
shuffled job list per epoch into the manifest.

The data is JSONL, parquet or a saved dataset, streamed (:mod:`.formats`); its records are token
ids, messages or ShareGPT conversations (:mod:`.records`), rendered by the chat template with the
data's options (:mod:`.chat`). ``dflash data show`` (:mod:`.show`) shows what the loss covers.
"""
