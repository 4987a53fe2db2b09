"""Where a run's shards live: one store that every host reads (``shared``, the default: one host, or a
shared filesystem), or one store per node (``node``, ``--node-local``: each node's NVMe).

The manifest records the layout in its metadata (:data:`KEY`) the first time ``extract`` or ``train``
opens it; a later process asking for the other layout is refused in one line (:func:`settle_layout`).

A **node** is a host name (:data:`dflash_staged.procs.HOST`, which ``DFLASH_NODE_NAME`` overrides:
one name per machine). A job's ``host`` is the node that claimed it, and after ``publish`` the node
whose disk holds its shard. With node-local stores:

- **extract's window is per node**: a claim counts only the jobs of its own node (claimed, written,
  consumed), so each node's disk holds at most ``--window`` shards and ``--window-bytes`` bytes; the
  run as a whole at most the number of nodes times that;
- **a trainer rank takes only its node's shards** (``take(node=...)``); the random draw mixes lengths
  within them as with one store. Consumption is recorded by rank 0, as always; the lowest rank of each
  node deletes its node's covered shards and marks them released (:class:`~dflash_staged.train.ledger.
  Ledger`), and checks the window rule against its node's ranks;
- **a lost node**: its claims return to pending when their leases expire; when the trainer job starts
  again without it (from the checkpoint copy every node keeps: :func:`dflash_staged.train.trainer.
  own_checkpoints`), rank 0 returns its written jobs to pending and marks its consumed (checkpoint-
  covered) jobs released (:meth:`~dflash_staged.manifest.base.Manifest.requeue_absent_nodes`);
- **a node that returns** removes the shards on its disk that its node no longer holds (another node's
  job now, or released): :func:`unwanted_on`, run by its extract and its trainer at start.
"""

from __future__ import annotations

import functools

from dflash_staged.manifest.states import ManifestError
from dflash_staged.procs import HOST

KEY = "store_layout"  # its value: "shared" or "node"


def settle_layout(m, node_local: bool, who: str) -> str:
    """Record this process's layout in the manifest if none is recorded yet; ManifestError naming the
    flag if the manifest holds the other one. Returns the layout."""
    want = "node" if node_local else "shared"
    m.forget_meta()
    have = m.meta.get(KEY)
    if have is None:
        m.set_meta(KEY, want)
        m.forget_meta()
        have = m.meta.get(KEY)
    if have != want:
        flag = "with --node-local" if have == "node" else "without --node-local"
        raise ManifestError(
            f"{m.address} runs with {'node-local stores' if have == 'node' else 'one shared store'} "
            f"(recorded by the first extract or train on it); {who} must run {flag} too"
        )
    return have


def node_of(layout: str) -> str | None:
    """The node whose jobs this process sees (its own, with node-local stores), or None (all)."""
    return HOST if layout == "node" else None


def unwanted_on(m, node: str | None):
    """The store cleanup's test of a final shard on ``node``'s disk (``job id -> bool``; None: one
    shared store)."""
    return functools.partial(m.shard_unwanted, node=node)
