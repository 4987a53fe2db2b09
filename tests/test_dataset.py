"""Dataset ingestion: pre-tokenised lines, chat messages, truncation, skipping, bad lines."""

import hashlib
import json

import numpy as np
import pytest

from dflash_staged.model.target.tiny import build_tiny_tokenizer
from dflash_staged.plan import dataset
from dflash_staged.plan.dataset import DatasetError, load_dataset, tokenize_messages

from helpers import cfg_for

# cfg_for's base here: short lines, at least 2 loss tokens, a 4-token block, the tiny tokenizer's <mask> (3)
DATASET = dict(
    data__max_len=64,
    data__overlength="truncate",
    data__token_budget=256,
    data__min_loss_tokens=2,
    drafter__block_size=4,
    drafter__mask_token_id=3,
)


def write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def row(ids, mask=None):
    return {"input_ids": list(ids), "loss_mask": list(mask if mask is not None else [1] * len(ids))}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_pretokenised_roundtrip_and_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "_load_tokenizer", lambda *_: pytest.fail("tokenizer loaded needlessly"))
    p = write(tmp_path / "d.jsonl", [row([4, 5, 6], [0, 1, 1]), "", row(range(10, 20))])
    s, digest = load_dataset(p, cfg_for(DATASET))
    assert digest == hashlib.sha256(p.read_bytes()).hexdigest()
    assert len(s) == 2 and s.lengths().tolist() == [3, 10]
    assert s.lines.tolist() == [1, 3]
    ids, mask = s.sample(0)
    assert ids.tolist() == [4, 5, 6] and mask.tolist() == [0, 1, 1]
    assert s.tokens.dtype == np.int32 and s.loss_mask.dtype == np.uint8 and s.offsets.dtype == np.int64
    assert s.stats == dict(
        lines=2,
        samples=2,
        bad=0,
        truncated=0,
        skipped_long=0,
        skipped_short_loss=0,
        last_record=3,
        format="JSONL, 2 token ids",
    )


def test_overlength_truncate_and_skip_and_short_loss(tmp_path):
    lines = [row(range(4, 24)), row(range(4, 9)), row(range(4, 14), [1] + [0] * 9)]
    p = write(tmp_path / "d.jsonl", lines)
    s, _ = load_dataset(p, cfg_for(DATASET, data__max_len=8))
    assert s.lengths().tolist() == [8, 5]
    assert s.sample(0)[0].tolist() == list(range(4, 12))
    assert (s.stats["truncated"], s.stats["skipped_long"], s.stats["skipped_short_loss"]) == (2, 0, 1)
    s, _ = load_dataset(p, cfg_for(DATASET, data__max_len=8, data__overlength="skip"))
    assert s.lengths().tolist() == [5]
    assert (s.stats["truncated"], s.stats["skipped_long"], s.stats["skipped_short_loss"]) == (0, 2, 0)
    # loss tokens are counted after truncation: only 1 of the first 8 positions carries loss
    p2 = write(tmp_path / "e.jsonl", [row(range(4, 24), [0] * 7 + [1] * 13), row(range(4, 9))])
    s, _ = load_dataset(p2, cfg_for(DATASET, data__max_len=8))
    assert s.stats["skipped_short_loss"] == 1 and s.lines.tolist() == [2]


def test_skip_bad_counts_and_first_error_otherwise(tmp_path):
    p = write(tmp_path / "d.jsonl", [row([4, 5]), "{oops", row([4, 3000]), row([6, 7])])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: field \(line\): malformed JSON"):
        load_dataset(p, cfg_for(DATASET))
    s, _ = load_dataset(p, cfg_for(DATASET), skip_bad=True)
    assert s.stats["bad"] == 2 and s.lines.tolist() == [1, 4]
    assert "d.jsonl:3: field input_ids" in s.bad_examples[1]


@pytest.mark.parametrize(
    "line, field, what",
    [
        ([1, 2], "(line)", "expected a JSON object"),
        ({"input_ids": [4, 5]}, "loss_mask", "missing field"),
        ({"loss_mask": [1]}, "input_ids", "missing field"),
        ({"input_ids": "abc", "loss_mask": [1]}, "input_ids", "list of integers"),
        ({"input_ids": [4, 5.5], "loss_mask": [1, 1]}, "input_ids", "5.5"),
        ({"input_ids": [4, [5]], "loss_mask": [1, 1]}, "input_ids", "list of integers"),
        ({"input_ids": [4, 2**70], "loss_mask": [1, 1]}, "input_ids", "list of integers"),
        ({"input_ids": [4, 5], "loss_mask": [1]}, "loss_mask", "has 1 values but input_ids has 2"),
        ({"input_ids": [4, 5], "loss_mask": [1, 2]}, "loss_mask", "value 2 is not 0 or 1"),
        ({"input_ids": [], "loss_mask": []}, "input_ids", "empty"),
        ({"input_ids": [4, 2048], "loss_mask": [1, 1]}, "input_ids", "id 2048 at position 1 is outside"),
        ({"input_ids": [-1, 4], "loss_mask": [1, 1]}, "input_ids", "id -1 at position 0"),
        ({"input_ids": [4, 3], "loss_mask": [1, 1]}, "input_ids", "mask token id 3"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing field"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a string"),
    ],
)
def test_bad_line_messages(tmp_path, line, field, what):
    p = write(tmp_path / "d.jsonl", [row([4, 5]), line])
    with pytest.raises(DatasetError) as e:
        load_dataset(p, cfg_for(DATASET))
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: field {field}: ") and what in msg and "--skip-bad" in msg


def test_non_utf8_empty_and_nothing_usable(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"input_ids": [4], "loss_mask": [1]}\n{"input_ids": [4, 5], "x": "\xff"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: .*byte \d+ is not valid UTF-8"):
        load_dataset(p, cfg_for(DATASET, data__min_loss_tokens=1))
    p.write_text("\n  \n")
    with pytest.raises(DatasetError, match="is empty"):
        load_dataset(p, cfg_for(DATASET))
    write(p, [row([4, 5], [0, 1])])
    with pytest.raises(DatasetError, match="no usable samples.*1 with fewer than 2 loss tokens"):
        load_dataset(p, cfg_for(DATASET))
    with pytest.raises(DatasetError, match="cannot read the data file"):
        load_dataset(tmp_path / "missing.jsonl", cfg_for(DATASET))


def loss_texts(tok, ids, mask):
    """Decoded runs of consecutive loss tokens."""
    out, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur)), cur.clear()
    if cur:
        out.append(tok.decode(cur))
    return out


CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris is the answer."},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "the data says so."},
]


def test_messages_loss_mask_covers_exactly_assistant_turns(tok):
    ids, mask = tokenize_messages(tok, CONV)
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert tok.decode(ids.tolist()) == full
    assert loss_texts(tok, ids, mask) == ["paris is the answer.<|im_end|>", "the data says so.<|im_end|>"]
    # no loss token carries any part of the user/system text or the role headers
    non_loss = tok.decode(ids[mask == 0].tolist())
    assert "paris" not in non_loss and "capital" in non_loss and non_loss.count("assistant") == 2


# A Qwen3-style template written for this test: earlier assistant turns lose their <think>
# block, the last one gets one (empty if absent), so rendering is not append-only.
THINK_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set c = m.content %}{%- set r = '' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set c = c.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{%- if loop.index0 > ns.last %}{{- '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + c }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_messages_history_rewriting_template():
    tok = build_tiny_tokenizer()  # a fresh instance: the template is changed below
    tok.chat_template = THINK_TEMPLATE
    conv = [dict(m) for m in CONV]
    conv[2]["content"] = "<think>hmm the capital</think>\n\nparis is the answer."
    conv[4]["content"] = "<think>data</think>the data says so."
    ids, mask = tokenize_messages(tok, conv)
    assert loss_texts(tok, ids, mask) == [
        "paris is the answer.<|im_end|>",
        "<think>\ndata\n</think>\n\nthe data says so.<|im_end|>",
    ]
    # assistant speaking first, and an empty final assistant turn
    conv = [
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": ""},
    ]
    ids, mask = tokenize_messages(tok, conv)
    assert loss_texts(tok, ids, mask) == ["hello world<|im_end|>", "<think>\n\n</think>\n\n<|im_end|>"]


def test_messages_lines_in_a_file(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(dataset, "_load_tokenizer", lambda *_: tok)
    conv = CONV[:3]
    p = write(tmp_path / "d.jsonl", [{"messages": conv}, row(range(4, 12))])
    s, _ = load_dataset(p, cfg_for(DATASET))
    ids, mask = s.sample(0)
    want_ids, want_mask = tokenize_messages(tok, conv)
    assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    # the tiny tokenizer maps the literal "<mask>" to id 3, the drafter's mask id: a bad line
    write(
        p,
        [{"messages": [{"role": "user", "content": "a <mask> b"}, {"role": "assistant", "content": "c d"}]}],
    )
    with pytest.raises(
        DatasetError, match=r"d\.jsonl:1: field messages \(tokenised\): contains the drafter's mask"
    ):
        load_dataset(p, cfg_for(DATASET))
