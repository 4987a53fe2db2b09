"""Elastic trainer jobs: nodes come and go, the job re-forms by itself (docs/multinode.md).

``--nnodes MIN:MAX --max-restarts K`` (``dflash node``, ``dflash train``) runs the trainer under
torchrun's elastic agent with the ``c10d`` rendezvous at ``--master-addr:--master-port`` (on
``dflash train``: ``--rdzv-endpoint HOST:PORT``), the rendezvous id derived from the manifest's
address so that every node of the run names the same job. When a node is lost, the ranks that remain
lose their peer at the next collective and exit; each node's agent restarts its ranks (one of the K
restarts), the job re-forms with the nodes that remain (at least MIN) and resumes from the newest
checkpoint every node holds (:mod:`dflash_staged.train.catchup`), the lost node's written jobs going
back to extract (node-local stores). A node that arrives (returning or new, at most MAX) makes the
agents restart their ranks without spending a restart: the job re-forms on more ranks, the new node
receives the newest checkpoint over the process group, and its ranks start with empty buffers.

The rendezvous lives in the agent of the node at the endpoint: that node must stay (losing it ends
the job, as it ends any torchrun job); put it on the most reliable node.
"""

from __future__ import annotations

import hashlib
import os

from dflash_staged.errors import DflashError

RDZV_CONF_ENV = "DFLASH_RDZV_CONF"  # torchrun's --rdzv-conf for elastic jobs (its timeouts)
# The agents' environment. With the rendezvous store shared with the trainer ranks (torch's default), a
# node that joins a running job waits forever for the round's MASTER_ADDR, which the rank-0 agent
# publishes only in its first round (torch 2.13, dynamic_rendezvous.next_rendezvous): every round
# publishes it when the sharing is off.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_nnodes(value: str | int, flag: str = "--nnodes") -> tuple[int, int]:
    """``"3"`` -> (3, 3); ``"2:3"`` -> (2, 3); one line for anything else."""
    text = str(value).strip()
    try:
        lo, colon, hi = text.partition(":")
        mn, mx = int(lo), int(hi if colon else lo)
    except ValueError:
        mn = mx = 0
    if not 1 <= mn <= mx:
        raise DflashError(
            f"{flag} {text!r}: give N, or MIN:MAX with 1 <= MIN <= MAX (an elastic range of nodes)"
        )
    return mn, mx


def is_elastic(nnodes: tuple[int, int], max_restarts: int) -> bool:
    return nnodes[0] < nnodes[1] or max_restarts > 0


def check_elastic(nnodes: tuple[int, int], max_restarts: int, endpoint: str | None, manifest) -> None:
    """Refuse, in one line, an elastic setting that cannot re-form."""
    mn, mx = nnodes
    if mn < mx and max_restarts == 0:
        raise DflashError(
            f"--nnodes {mn}:{mx} with --max-restarts 0: a job whose ranks may not restart cannot re-form "
            "when a node leaves or comes; give --max-restarts N (each lost node spends one; say 10)"
        )
    if not is_elastic(nnodes, max_restarts):
        return
    if not endpoint:
        raise DflashError(
            f"--nnodes {mn}:{mx}: give the rendezvous host (--master-addr on dflash node, --rdzv-endpoint "
            "HOST:PORT on dflash train): every node of the job names the same one"
        )
    if not str(manifest or "").startswith(("postgresql://", "postgres://")):
        raise DflashError(
            f"--nnodes {mn}:{mx}: the nodes share one manifest: give --manifest "
            "postgresql://USER@HOST:PORT/DB#NAME (docs/multinode.md)"
        )


def rdzv_id(manifest) -> str:
    """The rendezvous id of the manifest's trainer job: the same on every node."""
    return "dflash-" + hashlib.sha256(str(manifest).encode()).hexdigest()[:12]


def torchrun_args(
    nnodes: tuple[int, int], nproc: int, max_restarts: int, endpoint: str, manifest
) -> list[str]:
    """torchrun's arguments for this node's share of an elastic trainer job (:data:`RDZV_CONF_ENV`, when
    set, adds torchrun's ``--rdzv-conf``, e.g. ``last_call_timeout=5,join_timeout=300``)."""
    conf = os.environ.get(RDZV_CONF_ENV, "").strip()
    return [
        "--nnodes", f"{nnodes[0]}:{nnodes[1]}", "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id(manifest), *(["--rdzv-conf", conf] if conf else []),
    ]  # fmt: skip
