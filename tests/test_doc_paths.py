"""Every repository path the docs name exists, and every relative link in them resolves.

Scanned: README.md, docs/*.md and the comments of configs/*.toml. A *repository path* is a token whose
first component is a top-level directory tracked by git (``bench/``, ``configs/``, ``docs/``, ...), not
preceded by ``/``, ``~``, ``.``, ``$`` or a word character, so URLs (``https://github.com/...``), other
repositories' paths (``vllm/...``, DeepSpec's ``config/...``), absolute and home paths (``/nvme/...``,
``~/.cache/...``) and paths under a placeholder (``WORKDIR/store``) are not checked. Paths a run
produces (``runs/``, ``manifests/``, ``.cache/``) and patterns (``*``, ``?``, ``[]``, ``{}``, ``<>``)
are skipped. A markdown link outside code (``[text](target)``, not ``http...`` or ``mailto:``) must
resolve relative to its file, and its ``#anchor``, if any, must be a heading of the target page.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCED = {"runs", "manifests", ".cache"}  # written at run time; the docs name paths under them
PATTERN_CHARS = set("*?[]{}<>")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def top_level_dirs() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {p.split("/", 1)[0] for p in out.splitlines() if "/" in p} - PRODUCED


def path_regex(tops: set[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(t) for t in sorted(tops, key=len, reverse=True))
    # a brace group may hold commas ({,_seed1}); it makes the token a pattern, skipped below
    return re.compile(rf"(?<![\w./~$\-])(?:{alternatives})/(?:[\w.\-/*?\[\]<>]|\{{[^}}\s]*\}})*")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def config_comments(path: Path) -> list[tuple[int, str]]:
    """The comment text of each line of a TOML file (a whole-line comment, or what follows ' #')."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        s = line.lstrip()
        if s.startswith("#"):
            out.append((n, s))
        elif " #" in line:
            out.append((n, line.split(" #", 1)[1]))
    return out


def scanned_lines() -> list[tuple[Path, int, str]]:
    lines = [(f, n, t) for f in doc_files() for n, t in enumerate(f.read_text().splitlines(), 1)]
    for f in sorted((ROOT / "configs").glob("*.toml")):
        lines += [(f, n, t) for n, t in config_comments(f)]
    return lines


def named_paths(text: str, regex: re.Pattern[str]) -> list[str]:
    found = []
    for m in regex.finditer(text):
        token = m.group(0).rstrip(".")
        if PATTERN_CHARS & set(token):
            continue
        found.append(token)
    return found


def missing_paths() -> list[str]:
    regex = path_regex(top_level_dirs())
    missing = []
    for f, n, text in scanned_lines():
        for p in named_paths(text, regex):
            if not (ROOT / p).exists():
                missing.append(f"{f.relative_to(ROOT)}:{n}: {p}")
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = None if in_code else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def broken_links() -> list[str]:
    broken = []
    for f in doc_files():
        in_code = False
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if FENCE.match(line):
                in_code = not in_code
                continue
            if in_code:
                continue
            line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"[a-z][a-z0-9+.\-]*:", target):  # http:, https:, mailto:
                    continue
                where, _, anchor = target.partition("#")
                dest = (f.parent / where).resolve() if where else f
                if not dest.exists():
                    broken.append(f"{f.relative_to(ROOT)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{f.relative_to(ROOT)}:{n}: {target} (no heading #{anchor})")
    return broken


def test_every_path_the_docs_and_configs_name_exists():
    missing = missing_paths()
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_relative_link_in_the_docs_resolves():
    broken = broken_links()
    assert not broken, "links in the docs that do not resolve:\n" + "\n".join(broken)


def test_the_path_check_sees_what_it_should_and_nothing_else():
    regex = path_regex({"bench", "configs", "docs", "dflash_staged", "bin", "tests", "demo"})
    text = (
        "see `docs/x.md`, configs/y.toml and dflash_staged/a/b.py. Run bin/demo; tests/test_a.py:12; "
        "https://github.com/z-lab/dflash/docs/z.md vllm/model_executor/x.py ~/.cache/docs/a "
        "/nvme/configs/q.toml WORKDIR/docs/x bench/results/x_{a..e}.json demo/data/*.jsonl "
        "bench/results/dflash2_vs_dflash{,_seed1}.json my-docs/x.md $OUT/docs/x ./bin/test"
    )
    assert named_paths(text, regex) == [
        "docs/x.md",
        "configs/y.toml",
        "dflash_staged/a/b.py",
        "bin/demo",
        "tests/test_a.py",
    ]
    assert slug("Making the data: `dflash regenerate`") == "making-the-data-dflash-regenerate"
    assert slug("The demo's recipe") == "the-demos-recipe"
    assert slug("Where a step's time goes, and what moves it") == "where-a-steps-time-goes-and-what-moves-it"
