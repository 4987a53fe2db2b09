"""Serving a trained drafter: llama.cpp (built here, :mod:`.llamacpp`), and what vLLM and SGLang read."""
