"""Extracting through vLLM (``[target] engine = "vllm"``): :mod:`.engine` (one engine per extract worker,
the contract) and :mod:`.connector` (the KV connector vLLM loads by module path). Importing this package
does not import vLLM."""
