"""One node of several: ``dflash node --nnodes N --node-rank R --master-addr A`` (docs/multinode.md).

Each node runs its extract workers and its share of one torchrun trainer job (``--nproc-per-node`` its
train GPUs); node 0 plans, the others wait for its plan. With ``--node-local`` each node's store is its
own (:mod:`dflash_staged.manifest.layout`), and the window rule counts that node's ranks only.
"""

from __future__ import annotations

from dflash_staged.errors import DflashError

# the keys of launch.processes.NodeOptions that place a node among several
MULTINODE = ("nnodes", "nnodes_min", "max_restarts", "node_rank", "master_addr", "master_port", "node_local")


def check_multinode(o) -> None:
    """One line for a multi-node setting of ``o`` (a ``NodeOptions``) that cannot work."""
    from dflash_staged.launch.elastic import check_elastic

    endpoint = f"{o.master_addr}:{o.master_port}" if o.master_addr else None
    check_elastic((o.nnodes_min or o.nnodes, o.nnodes), o.max_restarts, endpoint, o.manifest)
    if o.nnodes > 1 and not o.master_addr:
        raise DflashError(f"--nnodes {o.nnodes}: give --master-addr (node 0's address, as torchrun takes it)")
    if not 0 <= o.node_rank < o.nnodes:
        raise DflashError(f"--node-rank {o.node_rank}: must be in 0..{o.nnodes - 1} for --nnodes {o.nnodes}")
    if o.nnodes > 1 and not str(o.manifest or "").startswith(("postgresql://", "postgres://")):
        raise DflashError(
            f"--nnodes {o.nnodes}: the nodes share one manifest: give --manifest "
            "postgresql://USER@HOST:PORT/DB#NAME (docs/multinode.md)"
        )


MANIFEST_WAIT_S = 600.0


def wait_for_manifest(address, timeout_s: float = MANIFEST_WAIT_S) -> None:
    """Until node 0's ``dflash plan`` has created the manifest (a node of several other than 0)."""
    import time

    from dflash_staged.manifest import Manifest

    deadline, said = time.time() + timeout_s, False
    while not Manifest.exists(address):
        if time.time() > deadline:
            raise DflashError(
                f"no manifest at {address} after {timeout_s:.0f} s: start node 0 (--node-rank 0), it plans"
            )
        if not said:
            print(f"[launch] waiting for node 0 to plan {address}", flush=True)
            said = True
        time.sleep(2.0)
