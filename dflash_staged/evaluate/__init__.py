"""``dflash eval``: greedy speculative decoding against the target, and the acceptance length tau."""
