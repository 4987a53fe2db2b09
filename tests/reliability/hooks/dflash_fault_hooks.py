"""Fault injection for the reliability tests, configured by the JSON in $DFLASH_TEST_HOOKS.

Patches are applied right after the named dflash_staged module is first imported (a meta-path
hook), so nothing is imported early and spawned extract workers get the same patches.

Keys (all optional):

* ``enospc_flag``: path. While that file exists, the store's file writes
  (``dflash_staged.store.shardfiles._os_write``) fail with ENOSPC once this process has written the
  number of bytes the file holds (empty = 0; the write that crosses it is cut short): a disk that
  fills up mid-file and stays full until the file is removed.
* ``checkpoint_enospc_flag``: path. While that file exists, a checkpoint's trainer state
  (``dflash_staged.train.checkpoint.save_file``) fails the way safetensors reports a full disk,
  after writing part of the file.
* ``fake_target``: ``{"hidden": H, "delay_s": s, "inf_token": id}``. ``load_target`` returns a fast
  fake whose tapped state k of token t at channel h is ``t * (k + 1) + h / 2`` (float32); with
  ``inf_token``, the last tapped layer holds inf at every token of that id (an overflow).
* ``commit_log``: path. Every shard published (``ShardStore.commit_staged``) appends
  ``"<job_id> <pid>"`` to it.
* ``crash``: ``{point: probability}`` and ``seed``. At each named point this process SIGKILLs
  itself with that probability (after appending ``"<point> <pid>"`` to ``crash_log``). Points:
  ``write`` (each block written to a shard file), ``commit`` (shard renamed into place, the
  manifest transaction not yet committed), ``delete`` (shard deleted, not yet marked released),
  ``checkpoint_fsync`` (a checkpoint written, not yet fsynced and renamed), ``checkpoint`` (checkpoint
  durable, shards not yet
  released), ``consume`` (step marked consumed, not yet logged or checkpointed), ``manifest_npy``
  (`dflash plan` has written one of the manifest's sample arrays under its temporary name).
* ``crash_after``: ``{point: n}``: SIGKILL this process at the n-th time it reaches ``point``.
* ``forward_error``: ``{"flag": path, "rank": r, "error": "oom" | "runtime", "keep": false}``.
  While that file exists, the next target forward (``Target.capture``) on tensor-parallel rank
  ``r`` (``$RANK``; 0 outside a group) removes it (with ``keep``: leaves it, so every forward
  fails) and raises ``torch.OutOfMemoryError`` or ``RuntimeError``: a failed forward, on one rank,
  before its collectives (as the leader's allocation of the full tap buffer would fail).
* ``slow_remove_s``: seconds. Each batch of shard files deleted
  (``dflash_staged.store.cleanup._remove``, the trainer's background remover) waits that long
  first: a slow disk freeing large files.
* ``die_holding_status_lock``: true. Extract worker 0 takes its status queue's write lock and
  SIGKILLs itself before working (a worker killed halfway through a report); every other worker
  sends one more report as it ends.
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import json
import os
import random
import signal
import sys
import time

CFG: dict = {}
_RNG = random.Random()
_written = 0


_seen: dict = {}


def _crash(point: str) -> None:
    p = (CFG.get("crash") or {}).get(point, 0.0)
    _seen[point] = _seen.get(point, 0) + 1
    if (p and _RNG.random() < p) or _seen[point] == (CFG.get("crash_after") or {}).get(point):
        if CFG.get("crash_log"):
            fd = os.open(CFG["crash_log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, f"{point} {os.getpid()}\n".encode())
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def _patch_shardfiles(mod) -> None:
    real = mod._os_write

    def write(fd, data):
        global _written
        flag = CFG.get("enospc_flag")
        if flag and os.path.exists(flag):
            try:
                budget = int(open(flag).read().strip() or 0)
            except (OSError, ValueError):
                budget = 0
            room = budget - _written
            if room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = data[:room]  # a short write fills the disk; the next write fails
        _crash("write")
        n = real(fd, data)
        _written += n
        return n

    mod._os_write = write


def _patch_store(mod) -> None:
    real_commit, real_delete = mod.ShardStore.commit_staged, mod.ShardStore.delete_shard

    def commit_staged(self, staged):
        real_commit(self, staged)
        if CFG.get("commit_log"):
            fd = os.open(CFG["commit_log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, f"{staged.info.job_id} {os.getpid()}\n".encode())
            os.close(fd)
        _crash("commit")

    def delete_shard(self, epoch, job_id):
        real_delete(self, epoch, job_id)
        _crash("delete")

    mod.ShardStore.commit_staged = commit_staged
    mod.ShardStore.delete_shard = delete_shard


def _patch_checkpoint(mod) -> None:
    real_save = mod.save_checkpoint

    def save_checkpoint(*a, **kw):
        out = real_save(*a, **kw)
        _crash("checkpoint")
        return out

    mod.save_checkpoint = save_checkpoint
    if CFG.get("checkpoint_enospc_flag"):
        real_save_file = mod.save_file

        def save_file(tensors, filename, metadata=None):
            if not os.path.exists(CFG["checkpoint_enospc_flag"]):
                return real_save_file(tensors, filename, metadata=metadata)
            with open(filename, "wb") as f:
                f.write(b"\0" * 4096)  # the disk fills up mid-file
            from safetensors import SafetensorError

            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        mod.save_file = save_file


def _patch_fsutil(mod) -> None:
    real = mod._fsync_tree  # fsyncs an atomic directory (a checkpoint) before its rename

    def fsync_tree(root):
        _crash("checkpoint_fsync")
        real(root)

    mod._fsync_tree = fsync_tree


def _patch_consume(cls) -> None:
    real = cls.consume

    def consume(self, *a, **kw):
        real(self, *a, **kw)
        _crash("consume")

    cls.consume = consume


def _patch_manifest(mod) -> None:
    _patch_consume(mod.SqliteManifest)


def _patch_manifest_pg(mod) -> None:
    _patch_consume(mod.PostgresManifest)


def _patch_manifest_build(mod) -> None:
    real_npy = mod._save_npy

    def save_npy(*a, **kw):
        real_npy(*a, **kw)
        _crash("manifest_npy")

    mod._save_npy = save_npy


class FakeTarget:
    def __init__(self, layer_ids, hidden: int, delay_s: float, inf_token=None):
        import torch

        self.torch = torch
        self.layer_ids = list(layer_ids)
        self.stored_ids, self.last_layer = list(layer_ids), None  # the taps only: no last layer stored
        self.captured_ids, self.topk, self.topk_temperature = list(layer_ids), 0, None  # and no top-k
        self.hidden_size = hidden
        self.num_layers = max(self.layer_ids) + 1
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.target_id = "fake-target"
        self.delay_s = delay_s
        self.inf_token = inf_token

    def capture(self, input_ids, attention_mask=None, keep=True):
        torch = self.torch
        if self.delay_s:
            time.sleep(self.delay_s)
        if not keep:  # a tensor-parallel follower
            return None
        B, L = input_ids.shape
        k = torch.arange(len(self.layer_ids), dtype=torch.float32).view(1, 1, -1, 1)
        h = torch.arange(self.hidden_size, dtype=torch.float32).view(1, 1, 1, -1)
        out = input_ids.float().view(B, L, 1, 1) * (k + 1) + h / 2
        if self.inf_token is not None:
            out[:, :, -1][input_ids == int(self.inf_token)] = float("inf")
        return out


def _patch_target_taps(mod) -> None:
    real = mod.Target.capture

    def capture(self, *a, **kw):
        spec = CFG["forward_error"]
        if int(os.environ.get("RANK", "0")) == int(spec.get("rank", 0)):
            try:
                if spec.get("keep"):
                    os.stat(spec["flag"])
                else:
                    os.remove(spec["flag"])  # only the process that removes it fails
            except FileNotFoundError:
                pass
            else:
                import torch

                if spec.get("error", "runtime") == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
                raise RuntimeError("injected forward failure")
        return real(self, *a, **kw)

    mod.Target.capture = capture


def _patch_target(mod) -> None:
    fake = CFG["fake_target"]

    def load_target(cfg, device="cpu", *, layer_ids=None, num_draft_layers=1, tp=1, logit_transform=None):
        return FakeTarget(
            layer_ids or [1],
            int(fake.get("hidden", 8)),
            float(fake.get("delay_s", 0.0)),
            fake.get("inf_token"),
        )

    mod.load_target = load_target


def expected_hidden(input_ids, num_layers: int, hidden: int):
    """What FakeTarget writes for these packed ids: [T, K, H]."""
    import torch

    k = torch.arange(num_layers, dtype=torch.float32).view(1, -1, 1)
    h = torch.arange(hidden, dtype=torch.float32).view(1, 1, -1)
    return input_ids.float().view(-1, 1, 1) * (k + 1) + h / 2


def _patch_extract_worker(mod) -> None:
    real = mod.worker_main

    def worker_main(index, devices, rank, opts, status_q, init_file=None):
        if index == 0:
            status_q._wlock.acquire()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            real(index, devices, rank, opts, status_q, init_file)  # ends in sys.exit
        finally:
            status_q.put(("note", index, "done"))  # its feeder thread needs the write lock to deliver it

    worker_main.__module__, worker_main.__qualname__ = mod.__name__, "worker_main"  # spawn pickles it by name
    mod.worker_main = worker_main


def _patch_cleanup(mod) -> None:
    real = mod._remove

    def _remove(paths):
        time.sleep(float(CFG["slow_remove_s"]))
        real(paths)

    mod._remove = _remove


def _crashes() -> bool:
    return bool(CFG.get("crash") or CFG.get("crash_after"))


# Each patch names the attributes it replaces directly, so a rename fails loudly (AttributeError at import).
_PATCHES = {
    "dflash_staged.store.shardfiles": (_patch_shardfiles, lambda: "enospc_flag" in CFG or _crashes()),
    "dflash_staged.store.shard_store": (_patch_store, lambda: "commit_log" in CFG or _crashes()),
    "dflash_staged.train.checkpoint": (
        _patch_checkpoint,
        lambda: _crashes() or "checkpoint_enospc_flag" in CFG,
    ),
    "dflash_staged.fsutil": (_patch_fsutil, _crashes),
    "dflash_staged.store.cleanup": (_patch_cleanup, lambda: "slow_remove_s" in CFG),
    "dflash_staged.manifest.sqlite": (_patch_manifest, _crashes),
    "dflash_staged.manifest.postgres": (_patch_manifest_pg, _crashes),
    "dflash_staged.manifest.build": (_patch_manifest_build, _crashes),
    "dflash_staged.model.target": (_patch_target, lambda: "fake_target" in CFG),
    "dflash_staged.model.target.taps": (_patch_target_taps, lambda: "forward_error" in CFG),
    "dflash_staged.extract.worker": (_patch_extract_worker, lambda: "die_holding_status_lock" in CFG),
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES or not _PATCHES[name][1]():
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        real_exec = spec.loader.exec_module
        patch = _PATCHES[name][0]

        def exec_module(module):
            real_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    CFG.update(json.loads(os.environ["DFLASH_TEST_HOOKS"]))
    _RNG.seed(f"{CFG.get('seed', 0)}-{os.getpid()}")
    sys.meta_path.insert(0, _Finder())
