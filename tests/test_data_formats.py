"""Data as it ships: messages and ShareGPT conversations in JSONL, parquet, saved datasets; bad rows."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_staged.config import load_config
from dflash_staged.manifest import Manifest
from dflash_staged.plan import formats
from dflash_staged.plan.dataset import DatasetError, data_hash, load_dataset

from helpers import cli, write_config

EXTRA = "[data]\nmin_loss_tokens = 1\ntoken_budget = 512\n"
FROM = {"system": "system", "user": "human", "assistant": "gpt"}
WORDS = (
    "the model token layer draft target block speculative decoding training data hidden state shard "
    "store manifest epoch bucket length batch worker window checkpoint resume replay"
).split()


def text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)) + "."


def conversations(n: int = 12) -> list[list[dict]]:
    """Varied conversations: some with a system turn, some multi-turn, of varied lengths."""
    out = []
    for i in range(n):
        conv = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for t in range(1 + i % 2):
            conv += [
                {"role": "user", "content": f"question {i}.{t}: " + text(i + t, 4 + i % 5)},
                {"role": "assistant", "content": text(i * 2 + t, 6 + (i * 5) % 17)},
            ]
        out.append(conv)
    return out


def as_sharegpt(conv: list[dict], system_field: bool = False) -> dict:
    """{"conversations": [{"from", "value"}]}; with `system_field` a system turn becomes a top-level field."""
    turns = [{"from": FROM[m["role"]], "value": m["content"]} for m in conv]
    if system_field and turns and turns[0]["from"] == "system":
        return {"system": turns[0]["value"], "conversations": turns[1:]}
    return {"conversations": turns}


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_parquet(path, records, row_group_size=5, schema=None):
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=row_group_size)
    return path


def save_dataset(path, records, split=None):
    import datasets

    ds = datasets.Dataset.from_list(records)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


def manifest_contents(mdir):
    with Manifest.open(mdir, readonly=True) as m:
        jobs = [
            (j.id, j.epoch, j.pos, j.bucket, j.sample_ids, j.real_tokens, j.padded_tokens) for j in m.jobs()
        ]
        samples = [tuple(a.tolist() for a in m.sample(i)) for i in range(len(m.sample_lengths()))]
        return jobs, samples, m.meta["chat"]


def test_every_form_plans_to_the_same_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "BATCH_ROWS", 5)  # several batches per file, and row groups of 5
    convs = conversations()
    msgs = [{"messages": c} for c in convs]
    share = [as_sharegpt(c, system_field=i % 2 == 0) for i, c in enumerate(convs)]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-00000-of-00002.parquet", share[:7])
    write_parquet(shards / "train-00001-of-00002.parquet", share[7:])
    inputs = {
        "JSONL, 12 messages": write_jsonl(tmp_path / "messages.jsonl", msgs),
        "JSONL, 12 conversations (from/value)": write_jsonl(tmp_path / "sharegpt.jsonl", share),
        "parquet, 12 conversations (from/value)": write_parquet(tmp_path / "sharegpt.parquet", share),
        "parquet, 12 messages": write_parquet(
            tmp_path / "messages.bin", msgs
        ),  # detected by content, not name
        "datasets.save_to_disk directory, 12 messages": save_dataset(tmp_path / "saved", msgs),
        "datasets.save_to_disk directory, 12 conversations (from/value)": save_dataset(
            tmp_path / "saved_dict", share, split="train"
        ),
        "2 files: parquet, 12 conversations (from/value)": shards,
    }
    cfg = write_config(tmp_path / "cfg.toml", EXTRA)
    got = {}
    for i, (fmt, data) in enumerate(inputs.items()):
        code, out = cli(
            "plan", "--config", cfg, "--data", data, "--manifest", tmp_path / f"m{i}", "--epochs", 2
        )
        assert code == 0, out
        assert f"format: {fmt}\n" in out and "samples: 12 " in out, out
        got[fmt] = manifest_contents(tmp_path / f"m{i}")
    first = next(iter(got.values()))
    jobs, samples, _ = first
    assert len(jobs) >= 4 and len({j[3] for j in jobs}) >= 2  # two epochs, several buckets: a real job list
    assert all(sum(mask) > 0 for _, mask in samples) and any(mask[0] == 0 for _, mask in samples)
    for fmt, contents in got.items():
        assert contents == first, fmt
    # planning the same saved dataset again is the same plan: a directory has a data identity too
    code, out = cli(
        "plan", "--config", cfg, "--data", tmp_path / "saved", "--manifest", tmp_path / "m4", "--epochs", 2
    )
    assert code == 0 and "already holds this plan" in out, out


def test_directory_identity_follows_its_files(tmp_path):
    convs = conversations(4)
    d = save_dataset(tmp_path / "saved", [{"messages": c} for c in convs])
    h = data_hash(d)
    assert data_hash(d) == h and data_hash(d, "a template") != h
    (d / ".notes").write_text("dot-files are not data")
    assert data_hash(d) == h
    arrow = next(d.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes() + b"\0")
    assert data_hash(d) != h


def bad_cases(tmp_path):
    """(data path, the words the one error line must hold) for each kind of bad row."""
    good = [
        {
            "conversations": [
                {"from": "human", "value": "what is the model"},
                {"from": "gpt", "value": "the model is a draft target block."},
            ]
        }
    ]
    p = tmp_path / "d.jsonl"
    unknown = write_jsonl(
        p, good + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]}]
    )
    yield unknown, [f"{p}:2: field conversations[1].from: unknown role 'bot'", "human, user, gpt"]
    write_jsonl(
        p, good + [{"messages": [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "x"}]}]
    )
    yield p, [f"{p}:2: field messages[1].role: unknown role 'gpt'", "conversations, with from/value"]
    write_jsonl(p, good * 2 + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}])
    yield p, [f"{p}:3: field conversations[1].value: missing field"]
    write_jsonl(p, good + [{"conversations": []}])
    yield p, [f"{p}:2: field conversations: is empty"]
    q = tmp_path / "d.parquet"
    schema = pa.schema(
        [("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.int64())])))]
    )
    write_parquet(q, [{"conversations": [{"from": "human", "value": 5}]}], schema=schema)
    yield q, [f"{q}: row 1: field conversations[0].value: expected a string, got int"]
    write_parquet(
        q, [{"input_ids": [4, 5], "loss_mask": [1, 1]}] * 6 + [{"input_ids": None, "loss_mask": [1]}]
    )
    yield q, [f"{q}: row 7: field input_ids: missing field"]
    write_parquet(q, [{"input_ids": ["4", "5"], "loss_mask": [1, 1]}])
    yield q, [f'{q}: row 1: field input_ids: expected a list of integers, found "4"']
    write_parquet(q, [{"messages": json.dumps([{"role": "user", "content": "hi"}])}])
    yield q, [f"{q}: row 1: field messages: got str; expected a non-empty list"]
    write_parquet(q, [{"text": "hi", "id": 1}])
    yield q, [f"{q}: the columns are text, id; a row needs messages, conversations"]
    d = save_dataset(
        tmp_path / "saved",
        good * 2 + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]}],
    )
    yield d, [f"{d}: row 3: field conversations[1].value: missing field (null)"]
    dd = save_dataset(tmp_path / "splits", good, split="train")
    save_dataset(tmp_path / "other", good).rename(dd / "test")
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    yield (
        dd,
        [f"{dd}: a DatasetDict with the splits train, test; give one split's directory", f"{dd / 'train'}"],
    )


def test_bad_rows_one_clear_line_and_nothing_left(tmp_path):
    cfg = write_config(tmp_path.parent / f"{tmp_path.name}-cfg.toml", EXTRA)
    n = 0
    for data, words in bad_cases(tmp_path):
        before = sorted(p.name for p in tmp_path.iterdir())
        code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", tmp_path / "manifests" / "m")
        assert code == 1 and out.count("\n") == 1 and out.startswith("error: ") and "Traceback" not in out, (
            out
        )
        assert all(w in out for w in words), (words, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no manifest, no temporary left
        n += 1
    assert n == 11


def test_without_the_data_extra_one_line_names_it(tmp_path, monkeypatch):
    cfg = load_config(write_config(tmp_path / "cfg.toml", EXTRA))
    q = write_parquet(tmp_path / "d.parquet", [{"input_ids": [4, 5], "loss_mask": [1, 1]}])
    d = save_dataset(tmp_path / "saved", [{"input_ids": [4, 5], "loss_mask": [1, 1]}])
    for mod in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, mod, None)  # as if not installed: importing it raises ImportError
    for path, what in ((q, "is a parquet file"), (d, "is a datasets.save_to_disk directory")):
        with pytest.raises(DatasetError) as e:
            load_dataset(path, cfg)
        assert str(e.value) == (
            f"{path} {what}; reading it needs the optional extra 'data': "
            "pip install 'dflash-staged[data]' (pyarrow, datasets)"
        )
