"""The models: the target (loading, tapped layers, kernel preflight, tiny targets in code), the DFlash
drafter, its reference config.json and its weights."""
