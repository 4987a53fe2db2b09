"""The trainer's device-facing setup, checked on CPU: the process group's long timeout and device
binding (a real two-rank gloo group), and shard pinning (off on CPU; the pinning path falls back)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dflash_staged.errors import DflashError
from dflash_staged.manifest.states import Job
from dflash_staged.store import ShardStore, StoreMeta
from dflash_staged.train import distributed
from dflash_staged.train.buffer import PINNED_FIELDS, ShardBuffer, pin_by_default


def test_process_group_arguments_carry_a_long_timeout_and_the_gpu(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    kw = distributed.init_kwargs(torch.device("cpu"))
    assert kw == {"backend": "gloo", "timeout": datetime.timedelta(hours=2)}  # not torch's 10 minutes
    kw = distributed.init_kwargs(torch.device("cuda", 3))  # builds no CUDA state: just the arguments
    assert kw["backend"] == "nccl" and kw["device_id"] == torch.device("cuda", 3)
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "36000")
    assert distributed.init_kwargs(torch.device("cpu"))["timeout"] == datetime.timedelta(hours=10)
    for bad in ("0", "-5", "soon", "inf"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(DflashError, match="DFLASH_TRAIN_COLLECTIVE_TIMEOUT_S=.*seconds > 0"):
            distributed.init_kwargs(torch.device("cpu"))


def _rank(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ[distributed.TIMEOUT_ENV] = "5400"
    d = distributed.Dist(torch.device("cpu"))
    pg = torch.distributed.distributed_c10d._get_default_group()
    timeout = pg._get_backend(torch.device("cpu")).options._timeout
    together = d.sum_int(rank + 1)
    d.close()
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{timeout.total_seconds()} {together}")


def test_a_trainer_group_is_created_with_the_long_timeout(tmp_path):
    """Read back from a real two-rank gloo group: the timeout the group was created with."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path / "r")), nprocs=2, start_method="fork")
    for rank in (0, 1):
        assert (tmp_path / f"r.{rank}").read_text() == "5400.0 3"


def _store_with_one_shard(tmp_path) -> tuple[ShardStore, Job]:
    store = ShardStore.create_or_open(
        tmp_path / "store",
        StoreMeta(manifest_id="m", target_id="t", layer_ids=[1, 2], hidden_size=8, logical_dtype="float32"),
    )
    ids = torch.arange(40, dtype=torch.int32)
    staged = store.stage_shard(
        0,
        7,
        ids.float()[:, None, None].expand(-1, 2, 8).contiguous(),
        ids,
        (ids % 3 > 0).to(torch.uint8),
        torch.tensor([0, 25, 40]),
        torch.tensor([0, 1]),
    )
    store.commit_staged(staged)
    job = Job(7, 0, 0, 0, [0, 1], 40, 40, "written", checksum=staged.info.checksum)
    return store, job


def read_one(store, job, pin):
    """The shard, read twice through one buffer (both readers at once), and the buffer."""
    buf = ShardBuffer(store, capacity=2, pin=pin)
    buf.admit([job, job])
    shard, _ = buf.load(buf.draw(set(), torch.Generator()))
    buf.load(buf.draw(set(), torch.Generator()))
    buf.close()
    return buf, shard


def test_shards_are_pinned_only_for_a_cuda_trainer_and_an_unpinnable_one_is_used_as_read(tmp_path, capsys):
    store, job = _store_with_one_shard(tmp_path)
    if not torch.cuda.is_available():
        assert pin_by_default() is False
    buf, plain = read_one(store, job, pin=None)
    assert buf.pin is pin_by_default()
    assert torch.equal(plain.hidden[:, 1, 3], plain.input_ids.float()) and plain.loss_mask.dtype == torch.bool
    buf, forced = read_one(store, job, pin=True)  # on CPU the allocator refuses: one warning, same data
    assert plain.hidden_scale is None  # only an FP8 store's shards have scales
    fields = [k for k in PINNED_FIELDS if k != "hidden_scale"]
    for k in (*fields, "cu_seqlens", "sample_ids"):
        assert torch.equal(getattr(forced, k), getattr(plain, k))
    if torch.cuda.is_available():
        assert all(getattr(forced, k).is_pinned() for k in fields) and not buf.pin_warned
    else:
        assert buf.pin_warned and capsys.readouterr().err.count("cannot be pinned") == 1
