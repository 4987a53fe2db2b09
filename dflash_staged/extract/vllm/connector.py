"""The KV connector vLLM's hidden-state extractor writes through: this project's, for CPU and CUDA.

vLLM (>= 0.18) extracts hidden states with the ``extract_hidden_states`` speculative method: a cache-only
"drafter" layer stores the tapped layers' states of every prompt token in its KV cache, and a KV connector
takes them out when the request finishes. vLLM's ``ExampleHiddenStatesConnector`` does that with CUDA
streams, events and pinned memory, which fail on a CPU (``pin_memory=True requires a CUDA ...``).

:class:`ShardConnector` is loaded by vLLM through ``kv_connector_module_path`` (this module's path) and
keeps the example's scheduler side (which request's blocks to save, delaying their release) and its
per-file lock (a reader sleeps on ``LOCK_SH`` until the write is done). Its worker side:

* copies the request's states out of the cache on the device's default stream, synchronously (a plain
  copy to host on CPU; on CUDA one device-to-host copy, which the extract worker would make anyway);
* writes ``{"hidden_states": [T, K, H], "token_ids": [T]}`` to the scratch file under a temporary name
  and renames it into place (a reader never sees half a file), then releases the lock;
* reports the request as done sending at once (no copy is in flight).

Only tensor-parallel rank 0 writes. The scratch folder and its bound are the extract worker's
(:mod:`dflash_staged.extract.vllm.engine`): one job's files at a time, removed as they are read.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """A finished copy: what the example's ``get_finished`` polls (a CUDA event there)."""

    @staticmethod
    def query() -> bool:
        return True


class ShardConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-state connector without streams or pinned memory (module docstring)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
        tensors = {"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            tmp = f"{pending.filename}.tmp"
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on
        self._req_copy_events[pending.req_id] = _Done()
