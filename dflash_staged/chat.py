"""Chat rendering: the chat template with the data's options, and the characters the loss covers.

:class:`ChatOptions` is how a conversation becomes text wherever one is rendered (``dflash plan``,
``dflash data show``, ``dflash eval``): the tokenizer's chat template, or the text of the
``[data] chat_template`` file when that is set, called with ``[data] chat_template_kwargs`` (e.g.
``enable_thinking=False``) on every rendering, the re-renderings below included. ``plan``
records the options in the manifest (meta ``chat``: :meth:`ChatOptions.record`) and the trainer
copies that record into each checkpoint's ``trainer_state.json``, so ``eval`` renders its
prompts the way the training data was rendered.

The loss covers the assistant turns only: each assistant message's text as the model generates
it, from the end of the generation prompt through the end-of-turn marker (e.g.
``content<|im_end|>``), trailing whitespace excluded. With a Qwen3 template and
``enable_thinking=False`` the generation prompt ends with an empty ``<think>`` block, so that
block is prompt, not loss; with thinking on it is loss.

**Reasoning** is stored in one shape, whoever generated it (``dflash regenerate`` in process or through
any server; :func:`assistant_message`): the answer in ``content`` and the reasoning, without its
``<think>`` tags, in ``reasoning_content`` (absent when the model reasoned nothing), each
whitespace-stripped. Rendering reads that field: a template that names ``reasoning_content`` (Qwen3's,
for one) gets the message as it is, and for any other template the reasoning is put back in front of the
answer as the model wrote it, ``<think>\nREASONING\n</think>\n\nANSWER``, so it is rendered and carries
the loss either way. ``content`` that still holds a ``<think>`` block is left as it is.

Assistant spans are found without ``{% generation %}`` markers (real templates such as Qwen3's
lack them). For assistant message i, the text that rendering ``messages[:i+1]`` adds to
rendering ``messages[:i]`` with the generation prompt is the turn; when the full rendering starts
with that prefix (append-only templates) the span is taken from there. Otherwise (the first
message, or a template that rewrites history, as Qwen3 strips the ``<think>`` block of earlier
turns) the conversation is re-rendered with message i's content replaced by two different
sentinels: the region where the renderings differ from the full one is the rendered content,
extended over the end-of-turn marker that follows it. Characters map to tokens through the fast
tokenizer's offsets: a token is a loss token when its character range overlaps an assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_staged.config import RENDER_ARGS, DataConfig
from dflash_staged.errors import BadRecord, DatasetError, DflashError


@dataclass
class ChatOptions:
    """The chat template's options: keyword arguments, and a template text replacing the tokenizer's."""

    kwargs: dict = field(default_factory=dict)
    template: str | None = None  # None = the tokenizer's own chat template
    template_path: str = ""  # where `template` was read from (for messages)

    @classmethod
    def from_config(cls, data: DataConfig) -> ChatOptions:
        """``[data] chat_template_kwargs`` and the text of ``[data] chat_template`` (if set)."""
        text = None
        if data.chat_template:
            try:
                text = Path(data.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                why = getattr(e, "strerror", None) or "not UTF-8 text"
                raise DatasetError(
                    f"data.chat_template = {data.chat_template!r}: cannot read the template file "
                    f"({why}); check the path (relative to the working directory)"
                ) from None
        return cls(dict(data.chat_template_kwargs), text, data.chat_template)

    def record(self) -> dict:
        """What the manifest and the checkpoints record (the inverse of :meth:`from_record`)."""
        return {"kwargs": dict(self.kwargs), "template": self.template, "template_path": self.template_path}

    @classmethod
    def from_record(cls, rec: dict) -> ChatOptions:
        return cls(dict(rec.get("kwargs") or {}), rec.get("template"), rec.get("template_path") or "")

    def override(self, kwargs: dict | None = None, template: str | Path | None = None) -> str:
        """Apply ``--chat-template-kwargs`` (merged key by key) and ``--chat-template FILE``, in place;
        returns what changed, for the report (e.g. ``" + --chat-template-kwargs"``)."""
        said = ""
        if kwargs:
            taken = sorted(set(kwargs) & RENDER_ARGS)
            if taken:
                raise DflashError(f"--chat-template-kwargs: dflash sets {taken[0]!r} itself; remove it")
            self.kwargs.update(kwargs)
            said += " + --chat-template-kwargs"
        if template:
            try:
                self.template, self.template_path = Path(template).read_text(encoding="utf-8"), str(template)
            except (OSError, UnicodeDecodeError) as e:
                raise DflashError(
                    f"--chat-template {template}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                    "give a Jinja template file"
                ) from None
            said += " + --chat-template"
        return said

    def check(self, tok) -> None:
        """A conversation can be rendered: there is a template, and offsets map characters to tokens."""
        if self.template is None and not getattr(tok, "chat_template", None):
            raise DatasetError(
                f"the target's tokenizer ({getattr(tok, 'name_or_path', '') or type(tok).__name__}) "
                "has no chat template: set [data] chat_template to a Jinja file, or pre-tokenise "
                "the data to input_ids/loss_mask"
            )
        if not getattr(tok, "is_fast", False):
            raise DatasetError(
                f"the tokenizer {type(tok).__name__} is not a fast tokenizer, so conversations "
                "cannot be mapped to loss tokens; pre-tokenise the data to input_ids/loss_mask"
            )

    def render(self, tok, messages: list[dict], gen: bool) -> str:
        template = self.template if self.template is not None else getattr(tok, "chat_template", None)
        if not (isinstance(template, str) and REASONING in template):
            messages = [_fold_reasoning(m) for m in messages]
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, chat_template=self.template, **self.kwargs
        )


REASONING = "reasoning_content"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def assistant_message(content: str, reasoning: str | None = None) -> dict:
    """An answer in the stored shape (module docstring), from a server's ``content`` and reasoning field,
    or from a generated text alone, whose reasoning ends at ``</think>``."""
    content = content or ""
    if reasoning is None and THINK_CLOSE in content:
        reasoning, _, content = content.partition(THINK_CLOSE)
        reasoning = reasoning.strip()
        reasoning = reasoning[len(THINK_OPEN) :] if reasoning.startswith(THINK_OPEN) else reasoning
    msg = {"role": "assistant", "content": content.strip()}
    if reasoning and reasoning.strip():
        msg[REASONING] = reasoning.strip()
    return msg


def _fold_reasoning(m: dict) -> dict:
    """``m`` for a template that does not read ``reasoning_content``: the reasoning back in the content."""
    if REASONING not in m:
        return m
    rest, r = {k: v for k, v in m.items() if k != REASONING}, m[REASONING]
    return {**rest, "content": f"{THINK_OPEN}\n{r}\n{THINK_CLOSE}\n\n{m.get('content') or ''}"} if r else rest


_DEFAULT = ChatOptions()


def off_prompt_warning(n: int) -> str:
    """The warning ``plan`` and ``data show`` print for `n` conversations off their generation prompt."""
    return (
        f"warning: in {n:,} conversation(s) the last assistant turn does not continue the generation "
        "prompt (e.g. reasoning with enable_thinking = false): it is not what the target generates in this "
        "mode; "
        "check the data against [data] chat_template_kwargs (dflash data show marks the loss)"
    )


_SENTINELS = ("\ue000\ue001", "\ue002\ue003")  # differ at both ends; private-use, never in text


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a[:n].encode("utf-32-le"), dtype=np.uint32)
    y = np.frombuffer(b[:n].encode("utf-32-le"), dtype=np.uint32)
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if len(neq) else n


def _sentinel(m: dict, s: str) -> dict:
    """``m`` with its text replaced by ``s``: the content ``s`` and no reasoning, so that the region that
    differs from the full rendering covers the reasoning too."""
    return {**{k: v for k, v in m.items() if k != REASONING}, "content": s}


def _diff_span(chat: ChatOptions, tok, messages: list[dict], i: int, full: str) -> tuple[int, int]:
    """Locate turn i in `full` by re-rendering with its content replaced by sentinels."""
    start, end = len(full), 0
    for s in _SENTINELS:
        alt = messages[:i] + [_sentinel(messages[i], s)] + messages[i + 1 :]
        r = chat.render(tok, alt, False)
        p = _common_prefix(full, r)
        q = _common_prefix(full[p:][::-1], r[p:][::-1])
        start, end = min(start, p), max(end, len(full) - q)
    # extend over the end-of-turn marker that follows the content (e.g. <|im_end|>)
    b = chat.render(tok, messages[:i] + [_sentinel(messages[i], _SENTINELS[0])], False)
    at = b.rfind(_SENTINELS[0])
    tail = b[at + len(_SENTINELS[0]) :].rstrip() if at >= 0 else ""
    if tail and full.startswith(tail, end):
        end += len(tail)
    return start, max(start, end)


def assistant_spans(
    tok, messages: list[dict], full: str, chat: ChatOptions = _DEFAULT, info: dict | None = None
) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full` (the rendering of `messages`).

    ``info["continues_prompt"]`` (when `info` is given) tells whether the last assistant turn
    renders as a continuation of the generation prompt before it. When it does not (e.g. a
    reasoning answer with Qwen3's ``enable_thinking=False``, whose prompt ends with an empty
    think block) the training text is not what the target sees when it generates: a mode mismatch.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = None
        if i:  # append-only templates: the turn is what messages[:i+1] adds to the generation prompt
            try:
                a = chat.render(tok, messages[:i], True)
                b = chat.render(tok, messages[: i + 1], False)
            except Exception:  # noqa: BLE001 - some templates refuse odd prefixes; fall back below
                a = b = ""
            if i == last and info is not None:
                info["continues_prompt"] = bool(a) and b.startswith(a)
            if a and b.startswith(a):
                end = len(a) + len(b[len(a) :].rstrip())
                if full.startswith(b[:end]):
                    span = (len(a), end)
        if span is None:  # history rewritten (e.g. Qwen3 strips old <think>) or first message
            try:
                span = _diff_span(chat, tok, messages, i, full)
            except Exception as e:  # noqa: BLE001
                raise BadRecord(
                    f"messages[{i}]",
                    f"the chat template failed on a re-rendering used to find the "
                    f"loss tokens ({type(e).__name__}: {e})",
                ) from None
        if span[0] < cursor:
            raise BadRecord(
                f"messages[{i}].content",
                "cannot locate this assistant message in the rendered chat template; "
                "pre-tokenise the record to input_ids/loss_mask",
            )
        spans.append(span)
        cursor = span[1]
    return spans


def tokenize_messages(
    tok, messages: list[dict], chat: ChatOptions = _DEFAULT, info: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Render `messages` with the chat template and options; return (ids, loss mask on assistant turns).

    `info` receives ``continues_prompt`` (see :func:`assistant_spans`)."""
    chat.check(tok)
    try:
        full = chat.render(tok, messages, False)
    except Exception as e:  # noqa: BLE001 - template errors (e.g. roles must alternate) are data errors
        raise BadRecord(
            "messages", f"the chat template rejected the conversation ({type(e).__name__}: {e})"
        ) from None
    spans = assistant_spans(tok, messages, full, chat, info)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offs = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for s, e in spans:
        mask |= ((offs[:, 0] < e) & (offs[:, 1] > s)).astype(np.uint8)
    return ids, mask
