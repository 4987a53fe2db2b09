"""One ``dflash regenerate`` worker process: take a batch of conversations, answer them, append.

A batch's conversations are answered round by round: round r generates, for every conversation
that has one, the answer to its r-th user turn, given the system and user turns and the answers
regenerated so far, rendered with the chat template (``add_generation_prompt``) and its options
(:class:`~dflash_staged.chat.ChatOptions`, as ``plan`` renders the training data).
Prompts are left-padded for generation. A generation stops at a stop token (``eos``) or after
``max_new_tokens`` (``length``); the answer is the text of the tokens before the stop token.
The answer is stored in the project's one shape for reasoning (:func:`~dflash_staged.chat.assistant_message`:
the reasoning before ``</think>`` in ``reasoning_content``, the rest in ``content``).
Sampling (``temperature > 0``, with ``top_p`` and ``top_k``, 0 = off) is seeded per batch and round, so a
rerun gives the same text. Each record's ``regenerated`` holds the target and the sampling settings.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import traceback
from typing import NamedTuple

import torch

from dflash_staged.chat import ChatOptions, assistant_message
from dflash_staged.errors import DflashError
from dflash_staged.procs import die_with_parent
from dflash_staged.regenerate.conversations import Conversation
from dflash_staged.regenerate.options import GenOptions
from dflash_staged.regenerate.parts import PartWriter


class BatchDone(NamedTuple):
    """Report: a batch is answered and appended to the worker's part file."""

    worker: int
    conversations: int
    new_tokens: int


class WorkerFailed(NamedTuple):
    """Report: the worker stopped on an error (exit code 2)."""

    worker: int
    text: str  # the message of a DflashError, else the traceback


def render(tok, history: list[dict], chat: ChatOptions) -> list[int]:
    """Token ids of the conversation so far plus the generation prompt."""
    return list(tok(chat.render(tok, history, gen=True), add_special_tokens=False)["input_ids"])


def answer(model, tok, convs: list[Conversation], o: GenOptions, stop_ids: list[int]) -> list[dict]:
    """The regenerated conversations (one record each, see :mod:`dflash_staged.regenerate.parts`)."""
    hist: list[list[dict]] = [[] for _ in convs]
    nxt = [0] * len(convs)  # next turn of each conversation to copy into its history
    stops: list[list[str]] = [[] for _ in convs]
    lens: list[list[int]] = [[] for _ in convs]
    dev = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]
    stop = set(stop_ids)

    def advance(i: int) -> bool:
        """Copy turns up to and including the next user turn; True if that user turn needs an answer."""
        turns = convs[i].turns
        while nxt[i] < len(turns):
            hist[i].append(turns[nxt[i]])
            nxt[i] += 1
            if hist[i][-1]["role"] == "user":
                return True
        return False

    need = [i for i in range(len(convs)) if advance(i)]
    rnd = 0
    while need:
        prompts = [render(tok, hist[i], o.chat) for i in need]
        width = max(map(len, prompts))
        ids = torch.full((len(need), width), pad, dtype=torch.long)
        mask = torch.zeros((len(need), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        sample = o.temperature > 0
        kw = (
            dict(do_sample=True, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k)
            if sample
            else dict(do_sample=False)
        )
        torch.manual_seed(o.seed * 1_000_003 + convs[need[0]].line * 131 + rnd)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=o.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=stop_ids,
                **kw,
            )
        for row, i in enumerate(need):
            new = out[row, width:].tolist()
            end = next((k for k, t in enumerate(new) if t in stop), None)
            stops[i].append("length" if end is None else "eos")
            new = new if end is None else new[:end]
            lens[i].append(len(new))
            hist[i].append(assistant_message(tok.decode(new, skip_special_tokens=True)))
        need = [i for i in need if advance(i)]
        rnd += 1
    return [
        {
            **c.extra,
            "messages": hist[i],
            "regenerated": {
                "line": c.line,
                "stop": stops[i],
                "new_tokens": lens[i],
                "model": o.target.model,
                "sampling": o.sampling(),
            },
        }
        for i, c in enumerate(convs)
    ]


def worker_main(rank: int, device: str, o: GenOptions, work_q, status_q) -> None:
    """Pull batches (lists of conversations) until the None sentinel, reporting each on ``status_q``
    (:class:`BatchDone`, :class:`WorkerFailed`); exit 0, or 2 on an error."""
    die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        sys.exit(2)
    if device.startswith("cpu"):
        n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        torch.set_num_threads(n or max(1, (os.cpu_count() or 1) // max(1, len(o.devices))))
    from dflash_staged.model.target import load_target, load_tokenizer, stop_token_ids

    writer = None
    try:
        model = load_target(o.target, device, layer_ids=[0]).model
        tok = load_tokenizer(o.target)
        stop_ids = stop_token_ids(model, tok)
        if not stop_ids:
            raise DflashError(
                f"{o.target.model}: neither the model nor its tokenizer names an eos token; "
                "generation could never stop before max_new_tokens"
            )
        writer = PartWriter(o.out, rank)
        while not stop.is_set():
            try:
                batch = work_q.get(timeout=0.5)
            except queue.Empty:
                continue
            if batch is None:
                break
            records = answer(model, tok, batch, o, stop_ids)
            writer.append(records)
            new_tokens = sum(sum(r["regenerated"]["new_tokens"]) for r in records)
            status_q.put(BatchDone(rank, len(records), new_tokens))
    except BaseException as e:  # noqa: BLE001 - reported by the supervisor
        status_q.put(WorkerFailed(rank, str(e) if isinstance(e, DflashError) else traceback.format_exc()))
        sys.exit(2)
    finally:
        if writer is not None:
            writer.close()
    sys.exit(0)
