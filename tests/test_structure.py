"""The code's own structure: job state only through the manifest package, imports that point one
way, modules of a readable size."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dflash_staged"
MANIFEST = PKG / "manifest"
# SQL keywords as they appear in statements; and the raw connection or transaction of a manifest.
SQL = re.compile(
    r"\b(SELECT\s+[\w*(]|UPDATE\s+\w+\s+SET|INSERT\s+(OR\s+\w+\s+)?INTO|DELETE\s+FROM|CREATE\s+TABLE|"
    r"BEGIN\s+IMMEDIATE)",
    re.IGNORECASE,
)
RAW = re.compile(r"\.(conn|_conn|_tx|tx)\b\s*(\(|\.)|\bsqlite3\b|\bpsycopg\b")
MAX_LINES = 420
# Test infrastructure that administers a throwaway database server (roles, schemas, sessions), never job
# state.
SERVER_ADMIN = {ROOT / "tests" / "pgcluster.py"}


def sources(*roots: Path):
    for root in roots:
        yield from sorted(root.rglob("*.py"))


def test_no_sql_outside_the_manifest_package():
    offenders = []
    for f in sources(PKG, ROOT / "bench", ROOT / "demo", ROOT / "tests"):
        if MANIFEST in f.parents or f == Path(__file__).resolve() or f in SERVER_ADMIN:
            continue
        for no, line in enumerate(f.read_text().splitlines(), 1):
            if SQL.search(line) or RAW.search(line):
                offenders.append(f"{f.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "job state is read or written outside dflash_staged/manifest:\n" + "\n".join(
        offenders
    )


def test_the_check_sees_sql():  # the pattern above must catch what it is there to catch
    for line in (
        'c.execute("UPDATE jobs SET state=? WHERE id=?")',
        'm.conn.execute("SELECT pid FROM jobs")',
        "with m.tx() as c:",
        "import sqlite3",
    ):
        assert SQL.search(line) or RAW.search(line), line


def _module(f: Path) -> str:
    rel = f.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the dflash_staged modules it imports (at any depth of the file)."""
    mods = {_module(f): f for f in sources(PKG)}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if n in mods and n != m:
                    graph[m].add(n)
    return graph


def test_imports_have_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):  # a package re-exporting its own modules
                continue
            if state.get(n) == 1:
                cycle.extend(path[path.index(n) :] + [n] if n in path else [m, n])
                return True
            if state.get(n) is None and visit(n, path + [n]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if state.get(m) is None and visit(m, [m]):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_stages_import_downward():
    """Lower layers never import higher ones: e.g. the manifest and the store know nothing of the stages."""
    layers = [
        ["errors", "procs", "children", "sizes", "split"],
        ["fsutil", "dtypes", "config", "chat", "preflight"],
        ["manifest", "store", "model"],
        ["plan", "extract", "train", "regenerate"],
        ["evaluate", "serve"],
        ["launch"],
        ["cli", "__main__"],
    ]
    rank = {name: i for i, names in enumerate(layers) for name in names}

    def layer(m: str) -> int:
        return rank[m.split(".")[1]]

    bad = [
        f"{m} -> {n}"
        for m, ns in import_graph().items()
        if m != "dflash_staged"
        for n in ns
        if n != "dflash_staged" and layer(n) > layer(m)
    ]
    assert not bad, "imports that point up:\n" + "\n".join(sorted(bad))


def test_modules_stay_readable():
    long = [
        f"{f.relative_to(ROOT)}: {n} lines"
        for f in sources(PKG)
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "split these modules:\n" + "\n".join(long)


def test_lines_stay_short():
    """No line over 110 characters anywhere in the code (ruff's E501 does not count a ``# noqa``)."""
    long = [
        f"{f.relative_to(ROOT)}:{no}: {len(line)} characters"
        for f in sources(PKG, ROOT / "tests", ROOT / "bench", ROOT / "demo")
        for no, line in enumerate(f.read_text().splitlines(), 1)
        if len(line) > 110
    ]
    assert not long, "wrap these lines:\n" + "\n".join(long)
