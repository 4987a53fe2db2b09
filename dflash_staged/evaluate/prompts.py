"""The prompts ``dflash eval`` decodes: JSONL lines of chat messages or token ids.

A ``{"messages": [...]}`` line (or ShareGPT's ``{"conversations": [{"from", "value"}]}``, read as
``dflash plan`` reads it) is rendered with the target's chat template and the generation prompt, after
dropping trailing assistant turns (a reference answer); an ``{"input_ids": [...]}`` line is used as
it is. Bad lines are errors naming ``file:line`` and the field.

The chat template's options (:class:`~dflash_staged.chat.ChatOptions`) are those the
training data was rendered with, so training and evaluation render alike
(:func:`chat_options`): the ``chat`` record in the drafter checkpoint's ``trainer_state.json``
(copied there from the manifest); for a checkpoint without one, the ``[data]`` section of
``--target`` when that is a config TOML; else none. ``--chat-template-kwargs`` updates the
keyword arguments key by key and ``--chat-template`` replaces the template.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_staged.chat import ChatOptions
from dflash_staged.config import load_config
from dflash_staged.errors import BadRecord, DflashError
from dflash_staged.plan.records import parse_conversations, parse_messages


def chat_options(
    ckpt: Path, target_spec: str, kwargs: dict | None = None, template: str | Path | None = None
) -> tuple[ChatOptions, str]:
    """(the options prompts are rendered with, where they came from); see the module docstring."""
    state = Path(ckpt) / "trainer_state.json"
    try:
        rec = json.loads(state.read_text()).get("chat") if state.is_file() else None
    except (OSError, ValueError) as e:
        raise DflashError(
            f"{state}: cannot read the checkpoint's trainer state ({e}); give a complete checkpoint"
        ) from None
    if rec is not None:
        chat, source = ChatOptions.from_record(rec), f"the checkpoint's record, {state}"
    elif target_spec.endswith(".toml"):
        chat, source = ChatOptions.from_config(load_config(target_spec).data), f"[data] of {target_spec}"
    else:
        chat, source = ChatOptions(), "the tokenizer's defaults (the checkpoint records none)"
    return chat, source + chat.override(kwargs, template)


def chat_line(template: str | None, kwargs: dict, source: str) -> str:
    """The report's line on how the prompts were rendered, e.g. ``chat template: the tokenizer's;
    options: none (from the checkpoint's record, run/step-8/trainer_state.json)``."""
    template = template or "the tokenizer's"
    options = json.dumps(kwargs) if kwargs else "none"
    return f"chat template: {template}; options: {options} (from {source})"


def _prompt_error(path, line: int, field: str, msg: str) -> DflashError:
    return DflashError(
        f'{path}:{line}: {field}: {msg}; each line must be {{"messages": [...]}} or {{"input_ids": [...]}}'
    )


def load_prompts(
    path: str | Path, tokenizer_fn, vocab_size: int, limit: int | None = None, chat: ChatOptions | None = None
) -> list[tuple[int, list[int]]]:
    """``[(line number, prompt ids)]``. ``messages`` lines are rendered with the chat template,
    `chat`'s options and the generation prompt, after dropping trailing assistant turns (a
    reference answer); ``tokenizer_fn()`` is called once, only if such a line exists."""
    chat = chat if chat is not None else ChatOptions()
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DflashError(f"{path}: cannot read the prompts file ({e.strerror}); check --prompts") from None
    except UnicodeDecodeError:
        raise DflashError(f"{path}: not UTF-8 text; the prompts file must be JSONL") from None
    tok, out = None, []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _prompt_error(path, no, "line", f"invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not ({"messages", "conversations", "input_ids"} & obj.keys()):
            raise _prompt_error(path, no, "line", "no messages, conversations or input_ids field")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise _prompt_error(path, no, "input_ids", "expected a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise _prompt_error(
                    path,
                    no,
                    "input_ids",
                    f"token id {bad[0]} is outside the target vocabulary 0..{vocab_size - 1}",
                )
        else:  # messages, or ShareGPT conversations (from/value), read as plan reads them
            try:
                msgs = (
                    parse_messages(obj["messages"])
                    if "messages" in obj
                    else parse_conversations(obj["conversations"], obj.get("system"))
                )
            except BadRecord as e:
                raise _prompt_error(path, no, e.field, str(e)) from None
            msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            if not msgs:
                raise _prompt_error(path, no, "messages", "only assistant turns; nothing to prompt with")
            if tok is None:
                tok = tokenizer_fn()
                if chat.template is None and not getattr(tok, "chat_template", None):
                    raise DflashError(
                        f"{path}:{no}: messages: the target's tokenizer has no chat template; "
                        "give --chat-template FILE, or input_ids lines instead"
                    )
            try:
                text = chat.render(tok, msgs, True)
            except Exception as e:  # noqa: BLE001 - template errors are data errors
                raise _prompt_error(
                    path, no, "messages", f"the chat template rejected it ({type(e).__name__}: {e})"
                ) from None
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        out.append((no, ids))
    if not out:
        raise DflashError(f"{path}: no prompts (the file is empty)")
    return out
