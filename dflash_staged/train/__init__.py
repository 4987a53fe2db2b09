"""``dflash train``: tail the manifest, draw length-mixed steps from a buffer of shards, train the DFlash
drafter, checkpoint, and release the shards a checkpoint covers."""
