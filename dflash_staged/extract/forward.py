"""One extract worker's device and forward: binding the device, and what a failed forward means.

* :func:`bind_device`, first thing in a worker, before anything touches CUDA: a worker on
  ``cuda:N`` makes ``N`` its current device (otherwise a CUDA call without an explicit device, such
  as leaving the shard writer's side-stream context, opens a context of ~0.5 GB on ``cuda:0`` in
  every worker), and asks the caching allocator for expandable segments (less fragmentation
  across jobs of varied shapes) unless ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` is
  set. On a CPU: nothing.
* :func:`batch_tensors` reads a job's samples; :func:`job_forward` runs its early-stopped forward
  and drops the padding; :func:`nonfinite_layers` screens its states: a job with an inf or a NaN
  is not published, but retried once and then failed (:func:`nonfinite_error` names the job, its
  samples and the layers).
* :func:`describe_failure`: the error text a failed forward records on its job. Out of GPU memory
  frees the allocator's cache and names the setting to lower (``data.token_budget``: padded tokens
  per job); the worker also prints it at once. The job goes back to pending and counts an attempt
  (``failed`` after ``extract.max_attempts``), so a batch that can never fit cannot loop forever.
* In a tensor-parallel group (more than one rank) a forward that raises on one rank must not be
  followed by any collective: the other ranks may be inside one of the model's collectives, and
  NCCL pairs calls by order, so a rank that went on to another collective would leave the group
  hanging until a watchdog. The rank raises :class:`RankFailed` and its process exits at once
  with :data:`~dflash_staged.extract.options.EXIT_RESTART` (:func:`exit_at_once`, which does not
  tear the group down); the supervisor then stops and restarts the whole group
  (:mod:`~dflash_staged.extract.supervisor`). The leader first sends the job back to pending:
  out of memory, or an error that is not a ``RuntimeError``, counts an attempt as it does for a
  single worker (:func:`counts_attempt`); any other ``RuntimeError`` does not, because that is how
  gloo and NCCL report another rank gone in the middle of a collective (the supervisor's bound on
  restarts in a row keeps an error of the job itself from looping).
"""

from __future__ import annotations

import os
import sys

import torch

from dflash_staged.errors import DflashError

ALLOC_CONF = "expandable_segments:True"


class RankFailed(DflashError):
    """A forward raised on this rank of a tensor-parallel group: the process must exit at once."""


def cuda_index(device: str | torch.device) -> int | None:
    """The CUDA device index of ``device`` (``cuda:3`` -> 3, ``cuda`` -> 0); None for a CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return None
    return 0 if d.index is None else d.index


def bind_device(device: str | torch.device) -> None:
    """Make ``device`` this process's current CUDA device (see the module docstring); CPU: nothing."""
    index = cuda_index(device)
    if index is None:
        return
    if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF  # the older name: read by every torch 2.x
    torch.cuda.set_device(index)


def batch_tensors(m, job):
    """The job's samples: right-padded ids + mask for the target, and the packed arrays of its shard."""
    from dflash_staged.model.target import pad_batch

    seqs, masks = [], []
    for sid in job.sample_ids:
        tok, mask = m.sample(sid)
        seqs.append(torch.from_numpy(tok.astype("int64")))
        masks.append(torch.from_numpy(mask.copy()))
    lengths = [len(s) for s in seqs]
    input_ids, attention_mask, _ = pad_batch(seqs, pad_id=0)
    packed_ids = torch.cat(seqs).to(torch.int32)
    loss_mask = torch.cat(masks).to(torch.uint8)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return (
        input_ids,
        attention_mask,
        lengths,
        packed_ids,
        loss_mask,
        cu,
        torch.tensor(job.sample_ids, dtype=torch.int64),
    )


def job_forward(target, ids: torch.Tensor, attn: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The tapped states of one job's right-padded batch, packed without the padding (a vLLM engine,
    :mod:`dflash_staged.extract.vllm.engine`, takes the sequences unpadded)."""
    from dflash_staged.model.target import pack_unpadded

    if hasattr(target, "capture_packed"):
        return target.capture_packed([ids[i, :n] for i, n in enumerate(lengths)])
    return pack_unpadded(target.capture(ids, attn), lengths)


NONFINITE_ATTEMPTS = 2  # a job whose states are not finite is retried once, then failed


def nonfinite_layers(hidden: torch.Tensor, layer_ids: list[int]) -> list[int]:
    """The target layers (``layer_ids[k]`` for ``hidden[:, k]``, ``hidden`` ``[T, K, H]``) whose states
    hold an inf or a NaN: such a shard is never published (a drafter's loss would turn NaN steps later,
    far from the cause)."""
    if hidden.numel() == 0:
        return []
    ok = torch.isfinite(hidden).all(dim=2).all(dim=0).tolist()  # [K]: one host sync per job
    return [layer_ids[k] if k < len(layer_ids) else k for k, good in enumerate(ok) if not good]


def nonfinite_error(job, layers: list[int], dtype) -> str:
    """The error a job with non-finite states records (one line: the job, its samples, the layers)."""
    ids = ", ".join(map(str, job.sample_ids[:8])) + (" ..." if len(job.sample_ids) > 8 else "")
    return (
        f"non-finite hidden states (inf or NaN) from target layer(s) {layers} of job {job.id} (samples "
        f"{ids}; {job.real_tokens} tokens, {dtype}): not published; an overflow in the target's forward "
        "(a long context in bf16/fp16, a damaged checkpoint). Check the samples, or try [target] dtype"
    )


def counts_attempt(e: BaseException) -> bool:
    """Whether a tensor-parallel forward's failure ``e`` counts an attempt on its job (module docstring)."""
    return isinstance(e, torch.OutOfMemoryError) or not isinstance(e, RuntimeError)


def describe_failure(e: BaseException, ids: torch.Tensor, device) -> str:
    """The error text of a failed forward of the batch ``ids``; out of memory frees the cache first."""
    text = f"{type(e).__name__}: {e}"
    if not isinstance(e, torch.OutOfMemoryError):
        return text
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    B, L = ids.shape
    return (
        f"out of memory on {device} in the target forward of {B} sequence(s) x {L} padded tokens "
        f"({B * L:,} tokens) ({first[:200]}); the allocator's cache was freed and the job goes back "
        "to pending. If it recurs, lower data.token_budget (padded tokens per job; re-plan) or give "
        "the target more memory (--tp N, fewer extract workers per GPU)"
    )


def exit_at_once(code: int, status_q) -> None:
    """End this process now, its reports delivered, without destroying its process group (another
    rank may still be inside a collective, which a teardown could wait on)."""
    try:
        status_q.close()
        status_q.join_thread()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
