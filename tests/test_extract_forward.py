"""Extract's forward in this process (:mod:`dflash_staged.extract.forward` and the worker loop): the
device a worker binds, the references the loop drops between forwards, and out of memory, against
a real SQLite manifest, a real shard store and the tiny target."""

from __future__ import annotations

import queue
import weakref

import pytest
import torch

from dflash_staged.extract import forward
from dflash_staged.extract.forward import bind_device, cuda_index, describe_failure
from dflash_staged.extract.group import Group
from dflash_staged.extract.messages import JobError, Seconds
from dflash_staged.extract.worker import Lease, Publisher, _loop

from helpers import extract_world, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def world(tmp_path, target):
    """A planned manifest of several jobs, its store, a worker's options and its running lease."""
    m, store, opts = extract_world(tmp_path, target, lease_s=30)
    lease = Lease(opts)
    lease.start()
    yield m, store, opts, lease
    lease.stop.set()
    lease.join(timeout=5)
    m.close()


def run_loop(m, target, publisher, lease, opts, keep_going=lambda: True) -> list:
    """The worker loop until nothing is left (or ``keep_going()`` turns false); the reports it sent
    (not its busy and idle seconds)."""
    q = queue.Queue()
    _loop(m, target, publisher, lease, opts, 0, q, keep_going=keep_going, group=Group())
    return [x for x in (q.get_nowait() for _ in range(q.qsize())) if not isinstance(x, Seconds)]


# ---------------------------------------------------------------------------------------------- the device


def test_a_worker_binds_the_index_of_its_cuda_device_and_leaves_a_cpu_alone(monkeypatch):
    assert cuda_index("cuda:3") == 3 and cuda_index(torch.device("cuda", 1)) == 1
    assert cuda_index("cuda") == 0 and cuda_index("cpu") is None
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    bind_device("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in forward.os.environ and not torch.cuda.is_initialized()
    bound: list[int] = []  # this machine has no GPU: record what would be bound
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    bind_device("cuda:3")
    assert bound == [3] and forward.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")  # the user's own is kept
    bind_device("cuda:1")
    assert bound == [3, 1] and "PYTORCH_CUDA_ALLOC_CONF" not in forward.os.environ


# ---------------------------------------------------------------------------------------------- the loop


class Watched:
    """The tiny target; at each forward it counts the earlier jobs' hidden states still alive."""

    def __init__(self, target, fail_first_with: BaseException | None = None):
        self.target, self.device = target, target.device
        self.handed: list[weakref.ref] = []
        self.alive: list[int] = []
        self.fail = fail_first_with

    def capture(self, ids, attn=None, keep=True):
        self.alive.append(sum(r() is not None for r in self.handed))
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        return self.target.capture(ids, attn, keep)

    def __getattr__(self, name):  # the rest is the target's (layer_ids, dtype, ...)
        return getattr(self.target, name)


class HostCopy:
    """What the CUDA publisher leaves the loop: the writer keeps a host copy, not the loop's tensor."""

    error = None

    def __init__(self, lease, watched: Watched):
        self.lease, self.watched, self.jobs = lease, watched, []

    def submit(self, job, hidden, *rest):
        self.watched.handed.append(weakref.ref(hidden))
        self.jobs.append(job.id)
        self.lease.drop(job)


def test_the_loop_holds_no_earlier_hidden_states_during_the_next_forward(world, target):
    m, _, opts, lease = world
    watched = Watched(target)
    pub = HostCopy(lease, watched)
    n = len(m.jobs())
    assert (
        run_loop(m, watched, pub, lease, opts, keep_going=lambda: len(pub.jobs) < n) == []
    )  # never published
    assert len(pub.jobs) == n >= 3
    assert watched.alive == [0] * len(pub.jobs)  # the previous job's states were dropped before each forward


def test_out_of_memory_frees_the_cache_names_the_setting_and_sends_the_job_back(world, target, capsys):
    m, store, opts, lease = world
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    watched = Watched(target, fail_first_with=oom)
    pub = Publisher(opts, store, lease)
    reports = run_loop(m, watched, pub, lease, opts)
    pub.close()
    (report,) = reports
    assert isinstance(report, JobError) and report.state == "pending"  # an attempt counted, not failed
    for text in (report.error, capsys.readouterr().err):  # said at once too, not only at the end
        assert "out of memory on cpu" in text and "data.token_budget" in text and "20.00 GiB" in text
    errors = [e for e in m.events() if e["kind"] == "error"]
    assert [e["job"] for e in errors] == [report.job]
    assert m.counts()["written"] == len(m.jobs())  # the job was retried and written; the rest went on
    assert store.has_shard(m.job(report.job).epoch, report.job)


def test_describe_failure_leaves_other_errors_as_they_are():
    ids = torch.zeros(3, 50, dtype=torch.long)
    assert describe_failure(ValueError("bad shape"), ids, "cpu") == "ValueError: bad shape"
    text = describe_failure(torch.OutOfMemoryError("CUDA out of memory."), ids, "cuda:2")
    assert "on cuda:2" in text and "3 sequence(s) x 50 padded tokens (150 tokens)" in text
