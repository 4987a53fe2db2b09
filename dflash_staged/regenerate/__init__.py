"""``dflash regenerate``: the target's own answers for a file of conversations, the data DFlash trains on.

Input: JSONL conversations (``{"messages": [{"role", "content"}, ...]}``). The system and user
turns are kept; every assistant turn is replaced by the target's own answer, generated turn by
turn with the chat template (and its options) and the history regenerated so far. Output: the
same JSONL form, one line per input conversation in input order, ready for ``dflash plan``.
Work is pulled by one worker process per device (:mod:`~dflash_staged.regenerate.worker`), or
by threads sending each conversation to an OpenAI-compatible server (vLLM, SGLang, llama-server:
:mod:`~dflash_staged.regenerate.remote`); either way the output is resumable and crash-safe
(:mod:`dflash_staged.regenerate.parts`).
"""
