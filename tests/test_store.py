"""Shard store: round trips, plain-zarr readability, crash safety, corruption, mismatch, ENOSPC, writer."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_staged.errors import DflashError
from dflash_staged.extract.writer import ShardWriter
from dflash_staged.store import (
    ShardCorruptError,
    ShardMissingError,
    ShardStore,
    ShardTruncatedError,
    StoreFullError,
    StoreMeta,
    StoreMismatchError,
    StoreMissingError,
    shardfiles,
)

REPO = Path(__file__).resolve().parents[1]
TORCH_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BITS_DT = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}


def meta(**kw) -> StoreMeta:
    base = dict(
        manifest_id="m1", target_id="tiny:qwen3", layer_ids=[1, 3], hidden_size=16, logical_dtype="bfloat16"
    )
    base.update(kw)
    return StoreMeta(**base)


def batch(lengths, k, h, dtype="bfloat16", seed=0):
    """A ragged packed batch; hidden holds random bit patterns (NaNs/infs included)."""
    rng = np.random.default_rng(seed)
    t = int(sum(lengths))
    bits = BITS_DT[dtype]
    info = torch.iinfo(bits)
    hidden = torch.from_numpy(rng.integers(info.min, info.max, size=(t, k, h), endpoint=True)).to(bits)
    hidden = hidden.view(TORCH_DT[dtype])
    ids = torch.from_numpy(rng.integers(0, 2**31 - 1, size=t))
    mask = torch.from_numpy(rng.integers(0, 2, size=t)).bool()
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)
    sids = torch.from_numpy(rng.integers(0, 2**62, size=len(lengths)))
    return hidden, ids, mask, cu, sids


def assert_same(shard, hidden, ids, mask, cu, sids):
    bits = {2: torch.int16, 4: torch.int32}[hidden.element_size()]
    assert shard.hidden.dtype == hidden.dtype and shard.hidden.shape == hidden.shape
    assert torch.equal(shard.hidden.view(bits), hidden.view(bits))
    assert torch.equal(shard.input_ids.long(), ids.long())
    assert torch.equal(shard.loss_mask.bool(), mask.bool())
    assert torch.equal(shard.cu_seqlens, cu) and torch.equal(shard.sample_ids, sids)


@pytest.fixture
def store(tmp_path):
    return ShardStore.create_or_open(tmp_path / "store", meta())


def write(store, epoch=0, job=7, lengths=(3, 5, 1), seed=0):
    data = batch(
        list(lengths), len(store.meta.layer_ids), store.meta.hidden_size, store.meta.logical_dtype, seed
    )
    return store.write_shard(epoch, job, *data), data


# ------------------------------------------------------------------------------- round trips


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    k=st.integers(1, 5),
    h=st.integers(1, 48),
    dtype=st.sampled_from(sorted(TORCH_DT)),
    comp=st.sampled_from(["none", "zstd"]),
    seed=st.integers(0, 2**16),
    job=st.integers(0, 10**9),
)
def test_round_trip(lengths, k, h, dtype, comp, seed, job):
    with tempfile.TemporaryDirectory() as d:
        s = ShardStore.create_or_open(
            Path(d) / "s",
            meta(layer_ids=list(range(k)), hidden_size=h, logical_dtype=dtype, compression=comp),
        )
        data = batch(lengths, k, h, dtype, seed)
        info = s.write_shard(3, job, *data)
        shard = s.read_shard(3, job, expected_checksum=info.checksum)
        assert_same(shard, *data)
        assert shard.nbytes == info.nbytes and info.checksum.startswith("xxh3_64:")
        if comp == "none":
            assert info.nbytes == s.estimate_nbytes(sum(lengths), len(lengths))
        again = ShardStore.open(Path(d) / "s").read_shard(3, job, verify=False)
        assert_same(again, *data)


def test_checksum_depends_on_content(store):
    a, _ = write(store, job=1, seed=1)
    b, _ = write(store, job=2, seed=2)
    c, _ = write(store, job=3, seed=1)
    assert a.checksum != b.checksum and a.checksum == c.checksum


def test_rewrite_replaces_and_delete_is_idempotent(store):
    write(store, job=4, seed=1)
    info, data = write(store, job=4, lengths=(2, 2), seed=9)
    assert_same(store.read_shard(0, 4, info.checksum), *data)
    assert list(store.iter_shards()) == [(0, 4)]
    before = store.disk_bytes()
    store.delete_shard(0, 4)
    store.delete_shard(0, 4)
    assert not store.has_shard(0, 4) and list(store.iter_shards()) == []
    assert store.disk_bytes() < before - info.nbytes + 1
    with pytest.raises(ShardMissingError):
        store.read_shard(0, 4)


def test_staged_shard_is_invisible_until_committed(store):
    data = batch([4, 4], 2, 16, seed=3)
    staged = store.stage_shard(0, 8, *data)
    assert staged.tmp.is_dir() and not store.has_shard(0, 8) and list(store.iter_shards()) == []
    store.commit_staged(staged)
    assert not staged.tmp.exists()
    assert_same(store.read_shard(0, 8, staged.info.checksum), *data)
    other = store.stage_shard(0, 9, *data)
    store.discard_staged(other)
    assert not other.tmp.exists() and not store.has_shard(0, 9)


def test_empty_shard_round_trips_and_reads_with_zarr(store):
    data = batch([], 2, 16)
    info = store.write_shard(0, 1, *data)
    assert_same(store.read_shard(0, 1, info.checksum), *data)
    g = zarr.open_group(store.root, mode="r")["shards/e0/j1"]
    assert g["hidden"].shape == (0, 2, 16) and g["cu_seqlens"][:].tolist() == [0]


def test_rejects_bad_input(store):
    h, ids, mask, cu, sids = batch([3, 2], 2, 16)
    with pytest.raises(ValueError, match="shape"):
        store.write_shard(0, 1, h[:, :1], ids, mask, cu, sids)
    with pytest.raises(ValueError, match="holds bfloat16"):
        store.write_shard(0, 1, h.float(), ids, mask, cu, sids)
    with pytest.raises(ValueError, match="cu_seqlens"):
        store.write_shard(0, 1, h, ids, mask, torch.tensor([0, 3, 4]), sids)
    assert not store.has_shard(0, 1)


# ------------------------------------------------------------------------------- plain zarr


@pytest.mark.parametrize("comp", ["none", "zstd"])
def test_plain_zarr_reads_the_store(tmp_path, comp):
    s = ShardStore.create_or_open(tmp_path / "s", meta(compression=comp))
    info, (h, ids, mask, cu, sids) = write(s, epoch=2, job=17)
    root = zarr.open_group(tmp_path / "s", mode="r")
    assert root.attrs["dflash_store"]["manifest_id"] == "m1"
    g = root["shards/e2/j17"]
    assert g.attrs["dflash_shard"]["checksum"] == info.checksum
    assert g["hidden"].attrs["logical_dtype"] == "bfloat16"
    hz = g["hidden"][:]
    assert hz.dtype == np.uint16 and np.array_equal(hz, h.view(torch.int16).numpy().view(np.uint16))
    h32 = (hz.astype(np.uint32) << 16).view(np.float32)  # the docstring's conversion
    assert np.array_equal(h32, h.float().numpy(), equal_nan=True)
    assert g["input_ids"].dtype == np.int32 and np.array_equal(g["input_ids"][:], ids.numpy())
    assert np.array_equal(g["loss_mask"][:], mask.numpy().astype(np.uint8))
    assert np.array_equal(g["cu_seqlens"][:], cu.numpy()) and np.array_equal(g["sample_ids"][:], sids.numpy())


# ------------------------------------------------------------------------------- crash safety

CRASH_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {repo!r})
    from dflash_staged.store import shardfiles
    from dflash_staged.store import ShardStore, StoreMeta
    calls = [0]
    real = shardfiles._os_write
    def slow_write(fd, data):
        calls[0] += 1
        if calls[0] == 3:  # after hidden/zarr.json and part of the hidden chunk
            n = real(fd, data[: len(data) // 2])
            print("PARTIAL", flush=True)
            time.sleep(600)
            return n
        return real(fd, data)
    shardfiles._os_write = slow_write
    s = ShardStore.open({root!r})
    s.write_shard(0, 5, torch.zeros(64, 2, 16, dtype=torch.bfloat16), torch.arange(64), torch.ones(64),
                  torch.tensor([0, 64]), torch.tensor([1]))
""")


def test_kill9_mid_write_leaves_no_shard_and_next_open_cleans(tmp_path, store):
    code = CRASH_WRITER.format(repo=str(REPO), root=str(store.root))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "PARTIAL"
        edir = store.root / "shards" / "e0"
        leftovers = [e.name for e in edir.iterdir() if e.name.startswith(".tmp~")]
        assert len(leftovers) == 1 and f"~{p.pid}~" in leftovers[0]
        assert store.cleanup_temp() == 0  # the writer is alive: its temp dir stays
        assert not store.has_shard(0, 5)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not store.has_shard(0, 5) and list(store.iter_shards()) == []
    with pytest.raises(ShardMissingError):
        store.read_shard(0, 5)
    ShardStore.create_or_open(store.root, store.meta)  # the next start cleans up
    assert [e.name for e in (store.root / "shards" / "e0").iterdir()] == ["zarr.json"]


def test_cleanup_keeps_foreign_host_temps_until_stale(store):
    write(store, job=1)
    foreign = store.root / "shards" / "e0" / ".tmp~j9~1~abcd~some-other-host"
    foreign.mkdir()
    assert store.cleanup_temp() == 0 and foreign.exists()
    assert store.cleanup_temp(stale_s=-1) == 1 and not foreign.exists()
    assert store.has_shard(0, 1)


def test_store_creation_is_atomic(tmp_path, monkeypatch):
    root = tmp_path / "s"

    def fail(fd, data):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(shardfiles, "_os_write", fail)
    with pytest.raises(OSError):
        ShardStore.create_or_open(root, meta())
    assert not root.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    errors, stores = [], []

    def create():
        try:
            stores.append(ShardStore.create_or_open(root, meta()))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert all(s.meta == meta() for s in stores)


def test_create_into_empty_dir_and_refuse_nonempty(tmp_path):
    (tmp_path / "empty").mkdir()
    assert ShardStore.create_or_open(tmp_path / "empty", meta()).meta == meta()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("x")
    with pytest.raises(StoreMismatchError, match="not empty"):
        ShardStore.create_or_open(tmp_path / "full", meta())


# ------------------------------------------------------------------------------- corruption


def chunk(store, job, name="hidden"):
    attrs = store.read_attrs(0, job)
    return store.shard_path(0, job) / attrs["arrays"][name]["file"]


def test_flipped_byte_is_detected(store):
    info, data = write(store, job=1)
    f = chunk(store, 1)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(ShardCorruptError, match="hidden fails its checksum"):
        store.read_shard(0, 1, info.checksum)
    assert store.read_shard(0, 1, verify=False).hidden.shape == data[0].shape  # verify can be switched off


def test_flipped_id_is_detected(store):
    write(store, job=1)
    f = chunk(store, 1, "input_ids")
    raw = bytearray(f.read_bytes())
    raw[0] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(ShardCorruptError, match="input_ids"):
        store.read_shard(0, 1)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_file_is_detected(store, verify):
    write(store, job=1)
    f = chunk(store, 1)
    os.truncate(f, f.stat().st_size - 3)
    with pytest.raises(ShardTruncatedError, match="truncated|bytes"):
        store.read_shard(0, 1, verify=verify)
    f.unlink()
    with pytest.raises(ShardTruncatedError, match="missing"):
        store.read_shard(0, 1, verify=verify)


def test_delete_shards_hides_them_at_once_and_removes_their_files_behind(store):
    from dflash_staged.store import Remover

    for j in (1, 2, 3):
        write(store, epoch=j % 2, job=j, seed=j)
    remover = Remover()
    store.delete_shards([(1, 1), (0, 2), (0, 9)], remover)  # (0, 9) never existed: idempotent
    assert list(store.iter_shards()) == [(1, 3)]  # gone for every reader before the files are
    remover.wait()
    left = sorted(p.name for p in store.root.rglob("*") if ".del~" in p.name)
    assert left == [] and list(store.iter_shards()) == [(1, 3)]
    store.delete_shards([(1, 3)], remover)
    store.delete_shards([], remover)  # waits for the batch before: one batch behind at most
    assert not [p for p in store.root.rglob("*") if ".del~" in p.name]


def test_deleted_dir_and_damaged_metadata(store):
    import shutil

    write(store, job=1)
    write(store, job=2)
    shutil.rmtree(store.shard_path(0, 1))
    with pytest.raises(ShardMissingError, match="does not exist"):
        store.read_shard(0, 1)
    (store.shard_path(0, 2) / "zarr.json").write_text("{not json")
    with pytest.raises(ShardCorruptError, match="unreadable"):
        store.read_shard(0, 2)


def test_replaced_shard_is_refused(store):
    info, _ = write(store, job=1, seed=1)
    write(store, job=1, seed=2)
    with pytest.raises(ShardCorruptError, match="manifest recorded"):
        store.read_shard(0, 1, expected_checksum=info.checksum)


def test_shard_errors_are_user_errors():
    for cls in (
        ShardCorruptError,
        ShardMissingError,
        ShardTruncatedError,
        StoreMismatchError,
        StoreFullError,
    ):
        assert issubclass(cls, DflashError)


# ------------------------------------------------------------------------------- mismatch


@pytest.mark.parametrize(
    "field,value",
    [
        ("manifest_id", "other"),
        ("target_id", "tiny:qwen3_5"),
        ("layer_ids", [1, 2]),
        ("hidden_size", 32),
        ("logical_dtype", "float32"),
    ],
)
def test_mismatch_is_refused(store, field, value):
    with pytest.raises(StoreMismatchError, match=field):
        ShardStore.create_or_open(store.root, meta(**{field: value}))
    with pytest.raises(StoreMismatchError, match=field):
        ShardStore.open(store.root, expect={field: value})
    assert ShardStore.open(store.root, expect={"manifest_id": "m1"}).meta == meta()


def test_missing_and_foreign_store(tmp_path):
    with pytest.raises(StoreMissingError, match=str(tmp_path / "nope")):
        ShardStore.open(tmp_path / "nope")
    assert not ShardStore.exists(tmp_path / "nope")
    zarr.open_group(tmp_path / "plain", mode="w")
    with pytest.raises(StoreMismatchError, match="not a dflash shard store"):
        ShardStore.open(tmp_path / "plain")
    doc = json.loads((tmp_path / "plain" / "zarr.json").read_text())
    doc["attributes"] = {"dflash_store": {**meta().__dict__, "format_version": 99}}
    (tmp_path / "plain" / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(StoreMismatchError, match="format_version 99"):
        ShardStore.open(tmp_path / "plain")


# ------------------------------------------------------------------------------- ENOSPC


def test_enospc_cleans_up_and_names_the_store(store, monkeypatch):
    old, old_data = write(store, job=3, seed=1)
    real = shardfiles._os_write

    def full(fd, data):
        if len(data) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(shardfiles, "_os_write", full)
    with pytest.raises(StoreFullError) as ei:
        write(store, job=3, lengths=(40, 40), seed=2)
    msg = str(ei.value)
    assert str(store.root) in msg and "bytes needed" in msg and str(store.estimate_nbytes(80, 2)) in msg
    assert [e.name for e in (store.root / "shards" / "e0").iterdir() if e.name.startswith(".")] == []
    assert_same(store.read_shard(0, 3, old.checksum), *old_data)  # the old shard is untouched


# ------------------------------------------------------------------------------- background writer


def test_writer_writes_in_background_and_reports(store):
    results = {}
    with ShardWriter(store, max_pending=2) as w:
        datas = {}
        for job in range(5):
            datas[job] = batch([job + 1, 3], 2, 16, seed=job)
            w.submit(1, job, *datas[job], on_done=lambda r, job=job: results.__setitem__(job, r))
    assert sorted(results) == list(range(5))
    for job, info in results.items():
        assert_same(store.read_shard(1, job, info.checksum), *datas[job])


def test_writer_reports_errors_and_close_reraises(store):
    results = []
    w = ShardWriter(store)
    h, ids, mask, cu, sids = batch([3], 2, 16)
    w.submit(0, 1, h[:, :1], ids, mask, cu, sids, on_done=results.append)  # wrong shape
    w.submit(0, 2, h, ids, mask, cu, sids, on_done=results.append)
    with pytest.raises(ValueError, match="shape"):
        w.close()
    assert isinstance(results[0], ValueError) and results[1].job_id == 2
    assert store.has_shard(0, 2) and not store.has_shard(0, 1)


def test_writer_stage_only_leaves_commit_to_the_caller(store):
    staged = []
    data = batch([5], 2, 16, seed=4)
    with ShardWriter(store, stage_only=True) as w:
        w.submit(0, 3, *data, on_done=staged.append)
    assert len(staged) == 1 and not store.has_shard(0, 3)
    store.commit_staged(staged[0])
    assert_same(store.read_shard(0, 3, staged[0].info.checksum), *data)


@pytest.mark.cuda
def test_writer_copies_from_cuda(store):
    results = []
    data = batch([100, 28], 2, 16)
    with ShardWriter(store) as w:
        for job in range(3):
            w.submit(0, job, *(t.cuda() for t in data), on_done=results.append)
    for info in results:
        assert_same(store.read_shard(0, info.job_id, info.checksum), *data)


@pytest.mark.parametrize(
    "where", ["page cache", "disk", "half of each", "a few blocks missing", "no RWF_NOWAIT"]
)
def test_a_large_chunk_reads_and_digests_alike_from_the_cache_and_the_disk(tmp_path, monkeypatch, where):
    """A chunk big enough to be digested beside its reads (``read_chunk``) gives the same bytes and the same
    XXH3 as one read and one digest, whether the page cache holds it, none of it or half of it, and where
    the system has no ``RWF_NOWAIT``; a file cut short while it is read is still a truncation."""
    from dflash_staged.store import shardfiles as sf

    data = np.random.default_rng(0).integers(0, 255, sf.OVERLAP_MIN * 3 + 12345, dtype=np.uint8)
    path = tmp_path / "c.0"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if where in ("disk", "half of each"):  # evict (all, or the second half) from the page cache
            half = data.size // 2 if where == "half of each" else 0
            os.posix_fadvise(fd, half, 0, os.POSIX_FADV_DONTNEED)
        if where == "a few blocks missing":  # cached, as far as its probes tell, but for two blocks
            os.posix_fadvise(fd, 7 * sf.BLOCK, 2 * sf.BLOCK, os.POSIX_FADV_DONTNEED)
            assert sf._cached(fd, data.size)
        assert sf._cached(fd, data.size) == (where in ("page cache", "a few blocks missing", "no RWF_NOWAIT"))
        if where == "no RWF_NOWAIT":
            monkeypatch.setattr(sf, "_NOWAIT", None)
        view = np.empty_like(data)
        got = sf.read_chunk(path, view, data.size, True, "none")
        assert got == sf.hash_hex(data) and np.array_equal(view, data)
        assert sf.read_chunk(path, np.empty_like(data), data.size, False, "none") == ""
    finally:
        os.close(fd)
    real = os.preadv
    monkeypatch.setattr(
        sf.os, "preadv", lambda fd, bufs, pos, *f: 0 if pos > data.size // 2 else real(fd, bufs, pos, *f)
    )
    with pytest.raises(sf.ChunkError, match="ended at byte") as e:
        sf.read_chunk(path, np.empty_like(data), data.size, True, "none")
    assert e.value.truncated
