"""How to split one node's devices between extract and train, given each side's measured rate.

Contract of :func:`choose_split` (``dflash node --split auto`` measures the rates:
:mod:`dflash_staged.launch.probe`):

* **Inputs.** ``n`` devices on the node; ``tp`` devices per extract worker (one tensor-parallel
  group, ``--tp``); ``extract_rate``: real tokens/s one extract worker writes (one GPU, or one
  group of ``tp``); ``train_rate``: real tokens/s one trainer rank consumes; ``scaling``: the
  data-parallel efficiency of more than one rank (``r`` ranks consume ``r x train_rate x scaling``
  when ``r > 1``, ``train_rate`` when ``r = 1``; 1.0 = linear).
* **Candidates.** ``g >= 1`` extract workers on ``g x tp`` devices and every other device a
  trainer rank (``r = n - g x tp >= 1``): extract supplies ``X = g x extract_rate``, train consumes
  ``Y`` as above, and the pipeline runs at ``P = min(X, Y)`` (a bounded window makes the faster
  side wait for the slower). Devices are never left out: another rank never lowers ``P``.
* **Choice.** The highest ``P``; among equal ones (within 1e-9 relative), the fewest idle devices
  (``g x tp x extract idle + r x train idle``), then the fewest extract devices.
* **Idle shares** (expected share of wall time a side's devices wait): extract ``1 - P / X`` (its
  workers wait on a full window), train ``1 - P / Y`` (its ranks wait for shards). The
  **bottleneck** is the side with no idle time; ``balanced`` when both idle under
  :data:`BALANCED`.
* **Too slow.** ``too_slow = "extract"`` when even the most extract workers that leave one trainer
  (``(n - 1) // tp`` of them) supply less than one rank consumes; ``"train"`` when even ``n - tp``
  ranks consume less than one extract worker supplies, and the chosen split is not balanced. That
  side is the bottleneck at every split: the choice is then the split giving it the most devices,
  and :meth:`Split.lines` says so.
* **Admissible.** ``rule(g, r)``, when given, refuses splits (returning the reason): ``--split
  auto`` passes the window rule (:mod:`dflash_staged.manifest.window`), so a split whose trainer
  ranks the window cannot serve is never chosen, only for the real extract to refuse it later.
* **Errors.** :class:`~dflash_staged.errors.DflashError` (one line naming the fix) when no split
  exists (``n < tp + 1``, or every one refused) or a rate is not positive.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_staged.errors import DflashError

BALANCED = 0.05  # both sides idle less than this: the split is balanced


@dataclass(frozen=True)
class Split:
    """One split of a node and what it is expected to do (see the module docstring)."""

    n: int
    tp: int
    extract_workers: int
    train_ranks: int
    extract_tok_s: float  # X: what the extract workers supply
    train_tok_s: float  # Y: what the trainer ranks consume
    too_slow: str | None = None  # "extract" / "train": that side is the bottleneck at every split

    @property
    def extract_devices(self) -> int:
        return self.extract_workers * self.tp

    @property
    def throughput(self) -> float:
        return min(self.extract_tok_s, self.train_tok_s)

    @property
    def extract_idle(self) -> float:
        return 1.0 - self.throughput / self.extract_tok_s

    @property
    def train_idle(self) -> float:
        return 1.0 - self.throughput / self.train_tok_s

    @property
    def idle_devices(self) -> float:
        return self.extract_devices * self.extract_idle + self.train_ranks * self.train_idle

    @property
    def bottleneck(self) -> str:
        if self.extract_idle < BALANCED and self.train_idle < BALANCED:
            return "balanced"
        return "extract" if self.extract_idle < self.train_idle else "train"

    def label(self) -> str:
        return f"{self.extract_devices} extract + {self.train_ranks} train"

    def lines(self) -> list[str]:
        """What ``--split auto`` prints about the chosen split."""
        workers = (
            f"{self.extract_workers} worker(s) of {self.tp}"
            if self.tp > 1
            else f"{self.extract_workers} worker(s)"
        )
        out = [
            f"chosen: {self.label()} of {self.n} device(s) (extract: {workers}; train: "
            f"{self.train_ranks} rank(s))",
            f"expected: {self.throughput:,.0f} tok/s through the pipeline (extract supplies "
            f"{self.extract_tok_s:,.0f}, train consumes {self.train_tok_s:,.0f}); idle: extract "
            f"{self.extract_idle:.0%}, train {self.train_idle:.0%}; "
            + ("balanced" if self.bottleneck == "balanced" else f"the bottleneck is {self.bottleneck}"),
        ]
        if self.too_slow == "extract":
            out.append(
                f"extract is too slow to keep even one trainer rank busy with {self.extract_devices} of "
                f"{self.n} devices: training will wait {self.train_idle:.0%} of the time at any split of "
                "this node; add extract workers on another node (a PostgreSQL manifest lets them join) "
                "or use a faster target setting"
            )
        elif self.too_slow == "train":
            out.append(
                f"training is too slow to keep up with one extract worker even on {self.train_ranks} of "
                f"{self.n} devices: extract will idle {self.extract_idle:.0%} of the time at any split of "
                "this node; the run goes at the trainer's pace"
            )
        return out


def refused(n: int, tp: int, rule=None) -> list[tuple[str, str]]:
    """The splits ``rule(extract workers, train ranks)`` refuses (its reason, else None), as
    ``("g x tp extract + r train", reason)``."""
    out = []
    for g in range(1, (n - 1) // tp + 1) if rule else ():
        why = rule(g, n - g * tp)
        if why:
            out.append((f"{g * tp} extract + {n - g * tp} train", why))
    return out


def candidates(
    n: int, tp: int, extract_rate: float, train_rate: float, scaling: float = 1.0, rule=None
) -> list[Split]:
    """Every split of ``n`` devices with at least one extract worker of ``tp`` and one trainer rank,
    but those ``rule(extract workers, train ranks)`` refuses (returns a reason: say, a window too
    small for that many trainer ranks); none left is an error naming the reason."""
    if n < tp + 1:
        raise DflashError(
            f"--split auto: {n} device(s) cannot hold one extract worker of --tp {tp} and one trainer "
            f"rank; give at least {tp + 1} devices"
        )
    for name, v in (("extract", extract_rate), ("train", train_rate)):
        if not v > 0:
            raise DflashError(f"--split auto: the measured {name} rate is {v!r} tok/s; it must be > 0")
    if not 0 < scaling <= 1:
        raise DflashError(f"--train-scaling {scaling!r}: give the data-parallel efficiency in (0, 1]")
    out, why = [], None
    for g in range(1, (n - 1) // tp + 1):
        r = n - g * tp
        no = rule(g, r) if rule else None
        if no:
            why = why or no
            continue
        y = train_rate * r * (1.0 if r == 1 else scaling)
        out.append(Split(n, tp, g, r, g * extract_rate, y))
    if not out:
        raise DflashError(f"--split auto: no split of {n} device(s) works: {why}")
    return out


def choose_split(
    n: int, tp: int, extract_rate: float, train_rate: float, scaling: float = 1.0, rule=None
) -> Split:
    """The split of ``n`` devices with the highest pipeline throughput (the module docstring), among
    the candidates ``rule`` admits."""
    cands = candidates(n, tp, extract_rate, train_rate, scaling, rule)
    best_p = max(c.throughput for c in cands)
    best = min(
        (c for c in cands if c.throughput >= best_p * (1 - 1e-9)),
        key=lambda c: (round(c.idle_devices, 9), c.extract_devices),
    )
    most_extract, most_train = cands[-1], cands[0]
    too_slow = None
    if best.bottleneck == "balanced":
        pass  # within BALANCED of keeping up: not worth a warning
    elif most_extract.extract_tok_s < train_rate:
        too_slow = "extract"
    elif most_train.train_tok_s < extract_rate:
        too_slow = "train"
    return Split(
        best.n, tp, best.extract_workers, best.train_ranks, best.extract_tok_s, best.train_tok_s, too_slow
    )


def table(cands: list[Split]) -> str:
    """One line of every candidate's expected throughput: ``1+7: 24,000 | 2+6: ...``."""
    return " | ".join(f"{c.extract_devices}+{c.train_ranks}: {c.throughput:,.0f}" for c in cands)
