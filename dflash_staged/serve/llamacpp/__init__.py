"""llama.cpp: :mod:`.build` (pinned source, cached build), :mod:`.convert` (its converter),
:mod:`.server` (a real llama-server)."""
