"""``dflash extract``: target workers that pull jobs from the manifest, run the target up to the deepest
tapped layer, and publish the tapped hidden states as store shards."""
