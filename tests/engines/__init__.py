"""Replays of serving engines' drafter loaders (config reads, weight-name mapping, parameters), as data and
code taken from their published source: :mod:`.vllm` (vLLM 0.33.0), :mod:`.sglang` (SGLang 0.5.23), on
:mod:`.common`'s tables. Nothing here imports an engine or downloads anything."""
