"""Fuzzed inputs: malformed dataset lines and config files through `dflash plan` (click's CliRunner).

Every malformed input must end with exit code 1 and one clean ``error: ...`` line that names
the file, the line (dataset lines; TOML syntax errors) and the field, with no Python traceback,
and leave no manifest (nor a temporary one) behind. ``--skip-bad`` instead counts the bad line
and plans the good ones. About 200 examples per property by default; ``slow`` runs thousands.

The tiny tokenizer is built once per test session (building it costs seconds), so messages lines
can appear in every example without slowing the loop.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dflash_staged.plan.dataset as dataset_mod
from dflash_staged.cli import main
from dflash_staged.config import _SECTION_CLASSES
from dflash_staged.plan.records import FROM_ROLES, ROLES

from helpers import TINY

FAST = settings(
    max_examples=200,
    deadline=None,
    derandomize=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
SLOW = settings(FAST, max_examples=3000)
VOCAB, MASK_ID = 2048, 3
_TOKENIZER = []


@pytest.fixture(autouse=True)
def cached_tokenizer(monkeypatch):
    def load(tcfg):
        if not _TOKENIZER:
            from dflash_staged.model.target.tiny import build_tiny_tokenizer

            _TOKENIZER.append(build_tiny_tokenizer())
        return _TOKENIZER[0]

    monkeypatch.setattr(dataset_mod, "_load_tokenizer", load)


# ---------------------------------------------------------------------------------------------- running
def plan(config: Path, data: Path, manifest: Path, *extra: str):
    res = CliRunner().invoke(
        main, ["plan", "--config", str(config), "--data", str(data), "--manifest", str(manifest), *extra]
    )
    return res


def assert_clean_error(res, manifest: Path, *must_contain: str) -> str:
    """Exit 1, one `error:` line, no traceback, the expected words; nothing left on disk."""
    out = res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        f"uncaught {type(res.exception).__name__}: {res.exception!r}\n{out}"
    )
    assert res.exit_code == 1, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out
    for word in must_contain:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert not manifest.exists(), "a manifest was left behind"
    assert not [p for p in manifest.parent.iterdir() if p.name.startswith(f".{manifest.name}.tmp")]
    return lines[0]


def good_line(rng_ids: list[int], prompt: int = 2) -> dict:
    return {"input_ids": rng_ids, "loss_mask": [0] * prompt + [1] * (len(rng_ids) - prompt)}


good_ids = st.lists(st.integers(4, VOCAB - 1), min_size=20, max_size=60)
good_lines = st.lists(good_ids.map(good_line), min_size=1, max_size=4)
GOOD_CHAT = {
    "messages": [
        {"role": "user", "content": "hello there, how are you today?"},
        {"role": "assistant", "content": "I am fine, thank you very much for asking me that."},
    ]
}

# ---------------------------------------------------------------------------------------------- bad lines
ids = st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=30)
not_int = st.one_of(
    st.text(max_size=5),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.lists(st.text(max_size=2), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
huge = st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63)))
json_text = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)


def _raw(obj) -> bytes:
    return json.dumps(obj).encode()


@st.composite
def bad_line(draw) -> tuple[bytes, set[str]]:
    """(raw line bytes, acceptable `field` names in the error)."""
    kind = draw(
        st.sampled_from(
            [
                "json",
                "utf8",
                "not_object",
                "missing_ids",
                "missing_mask",
                "ids_type",
                "ids_elem",
                "ids_huge",
                "mask_type",
                "mask_value",
                "mismatch",
                "empty",
                "vocab",
                "negative",
                "mask_token",
                "both",
                "messages",
                "deep",
                "long_int",
                "nan",
                "conversations",
            ]
        )
    )
    x = draw(ids)
    mask = [1] * len(x)
    if kind == "json":
        text = json.dumps(good_line(x))
        cut = draw(st.integers(1, len(text) - 1))
        junk = draw(st.sampled_from(["", "}", ",", "x", "]]", "'"]))
        text = text[:cut] + junk
        try:
            json.loads(text)
            text += "x"  # the cut happened to give valid JSON: make it malformed
        except ValueError:
            pass
        return text.encode(), {"(line)"}
    if kind == "utf8":
        text = json.dumps(good_line(x)).encode()
        at = draw(st.integers(0, len(text)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\x80"]))
        return text[:at] + bad + text[at:], {"(line)"}
    if kind == "not_object":
        obj = draw(json_text.filter(lambda o: not isinstance(o, dict)))
        return _raw(obj), {"(line)"}
    if kind == "missing_ids":
        obj = draw(
            st.dictionaries(
                st.text(max_size=6).filter(lambda k: k not in ("input_ids", "messages")),
                json_text,
                max_size=3,
            )
        )
        return _raw(obj), {"input_ids"}
    if kind == "missing_mask":
        return _raw({"input_ids": x}), {"loss_mask"}
    if kind == "ids_type":
        return _raw(
            {"input_ids": draw(not_int.filter(lambda v: not isinstance(v, list) or v)), "loss_mask": mask}
        ), {"input_ids"}
    if kind == "ids_elem":
        i = draw(st.integers(0, len(x) - 1))
        y = list(x)
        y[i] = draw(
            st.one_of(
                st.text(max_size=3),
                st.floats(allow_nan=False),
                st.booleans(),
                st.none(),
                st.lists(st.integers(4, 9), min_size=1, max_size=2),
            )
        )
        return _raw({"input_ids": y, "loss_mask": mask}), {"input_ids"}
    if kind == "ids_huge":
        y = list(x)
        y[draw(st.integers(0, len(x) - 1))] = draw(huge)
        return _raw({"input_ids": y, "loss_mask": mask}), {"input_ids"}
    if kind == "mask_type":
        return _raw(
            {"input_ids": x, "loss_mask": draw(not_int.filter(lambda v: not isinstance(v, list) or v))}
        ), {"loss_mask"}
    if kind == "mask_value":
        m = list(mask)
        m[draw(st.integers(0, len(x) - 1))] = draw(
            st.one_of(st.integers(2, 2**40), st.integers(-(2**40), -1))
        )
        return _raw({"input_ids": x, "loss_mask": m}), {"loss_mask"}
    if kind == "mismatch":
        n = draw(st.integers(1, 40).filter(lambda k: k != len(x)))
        return _raw({"input_ids": x, "loss_mask": [1] * n}), {"loss_mask"}
    if kind == "empty":
        return _raw({"input_ids": [], "loss_mask": []}), {"input_ids"}
    if kind == "vocab":
        y = list(x)
        y[draw(st.integers(0, len(x) - 1))] = draw(st.integers(VOCAB, 2**62))
        return _raw({"input_ids": y, "loss_mask": mask}), {"input_ids"}
    if kind == "negative":
        y = list(x)
        y[draw(st.integers(0, len(x) - 1))] = draw(st.integers(-(2**62), -1))
        return _raw({"input_ids": y, "loss_mask": mask}), {"input_ids"}
    if kind == "mask_token":
        y = list(x)
        y[draw(st.integers(0, len(x) - 1))] = MASK_ID
        return _raw({"input_ids": y, "loss_mask": mask}), {"input_ids"}
    if kind == "both":
        return _raw({"input_ids": x, "loss_mask": mask, **GOOD_CHAT}), {"messages"}
    if kind == "conversations":
        return draw(bad_conversation())
    if kind == "messages":
        i = draw(st.integers(0, 1))
        msgs = json.loads(json.dumps(GOOD_CHAT["messages"]))
        how = draw(
            st.sampled_from(
                [
                    "not_list",
                    "empty",
                    "item",
                    "no_role",
                    "no_content",
                    "role_type",
                    "content_type",
                    "role_unknown",
                ]
            )
        )
        if how == "not_list":
            return _raw({"messages": draw(not_int.filter(lambda v: not isinstance(v, list)))}), {"messages"}
        if how == "empty":
            return _raw({"messages": []}), {"messages"}
        if how == "item":
            msgs[i] = draw(not_int.filter(lambda v: not isinstance(v, dict)))
            return _raw({"messages": msgs}), {f"messages[{i}]"}
        if how in ("no_role", "no_content"):
            key = how[3:]
            del msgs[i][key]
            return _raw({"messages": msgs}), {f"messages[{i}].{key}"}
        if how == "role_unknown":
            msgs[i]["role"] = draw(st.text(max_size=8).filter(lambda r: r not in ROLES))
            return _raw({"messages": msgs}), {f"messages[{i}].role"}
        key = how.split("_")[0]
        msgs[i][key] = draw(not_int.filter(lambda v: not isinstance(v, str)))
        return _raw({"messages": msgs}), {f"messages[{i}].{key}"}
    if kind == "deep":
        n = draw(st.integers(2000, 200000))
        return (b'{"input_ids": ' + b"[" * n + b"]" * n + b"}"), {"(line)", "input_ids"}
    if kind == "long_int":
        return b'{"input_ids": [' + b"7" * draw(st.integers(4301, 20000)) + b'], "loss_mask": [1]}', {
            "(line)",
            "input_ids",
        }
    assert kind == "nan"
    y = list(x)
    y[draw(st.integers(0, len(x) - 1))] = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
    text = json.dumps({"input_ids": y, "loss_mask": mask})
    return re.sub(r'"(NaN|-?Infinity|1e999)"', r"\1", text).encode(), {"input_ids"}


@st.composite
def bad_conversation(draw) -> tuple[bytes, set[str]]:
    """A ShareGPT-style line broken one way: (raw line, acceptable fields)."""
    turns = [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "I am fine, thank you."}]
    i = draw(st.integers(0, 1))
    how = draw(st.sampled_from(["not_list", "empty", "item", "no_key", "type", "unknown_role", "system"]))
    if how == "not_list":
        return _raw({"conversations": draw(not_int.filter(lambda v: not isinstance(v, list)))}), {
            "conversations"
        }
    if how == "empty":
        return _raw({"conversations": []}), {"conversations"}
    if how == "item":
        turns[i] = draw(not_int.filter(lambda v: not isinstance(v, dict)))
        return _raw({"conversations": turns}), {f"conversations[{i}]"}
    if how == "system":
        return _raw(
            {
                "system": draw(not_int.filter(lambda v: v is not None and not isinstance(v, str))),
                "conversations": turns,
            }
        ), {"system"}
    key = draw(st.sampled_from(["from", "value"]))
    if how == "no_key":
        del turns[i][key]
    elif how == "type":
        turns[i][key] = draw(not_int.filter(lambda v: not isinstance(v, str)))
    else:
        key = "from"
        turns[i]["from"] = draw(st.text(max_size=8).filter(lambda r: r not in FROM_ROLES))
    return _raw({"conversations": turns}), {f"conversations[{i}].{key}"}


def _dataset_case(good, bad, where, skip_bad, chat):
    bad_raw, fields = bad
    lines = [json.dumps(x).encode() for x in good]
    if chat:
        lines.append(json.dumps(GOOD_CHAT).encode())
    pos = min(where, len(lines))
    lines.insert(pos, bad_raw)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        path = d / "data.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        manifest = d / "manifest"
        if skip_bad:
            res = plan(TINY, path, manifest, "--skip-bad")
            assert res.exit_code == 0, res.output
            assert f"samples: {len(lines) - 1:,}" in res.output and "1 bad" in res.output, res.output
            assert (manifest / "manifest.db").is_file()
            return
        line = assert_clean_error(plan(TINY, path, manifest), manifest, f"{path}:{pos + 1}:")
        field = re.search(r":\d+: field (\S+):", line)
        assert field and field.group(1) in fields, (line, fields)


@FAST
@given(good=good_lines, bad=bad_line(), where=st.integers(0, 5), skip_bad=st.booleans(), chat=st.booleans())
@example(
    good=[good_line(list(range(4, 40)))], bad=(b"[" * 100000, {"(line)"}), where=0, skip_bad=False, chat=False
)
@example(
    good=[good_line(list(range(4, 40)))],
    bad=(b'{"input_ids": [' + b"9" * 5000 + b"]}", {"(line)"}),
    where=1,
    skip_bad=False,
    chat=False,
)
@example(
    good=[good_line(list(range(4, 40)))],
    bad=(b'{"input_ids": [5, true, 7], "loss_mask": [1, 1, 1]}', {"input_ids"}),
    where=0,
    skip_bad=False,
    chat=False,
)
def test_fuzz_dataset_lines(good, bad, where, skip_bad, chat):
    _dataset_case(good, bad, where, skip_bad, chat)


@pytest.mark.slow
@SLOW
@given(good=good_lines, bad=bad_line(), where=st.integers(0, 5), skip_bad=st.booleans(), chat=st.booleans())
def test_fuzz_dataset_lines_slow(good, bad, where, skip_bad, chat):
    _dataset_case(good, bad, where, skip_bad, chat)


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", ["is empty"]),
        (b"\n\n  \n", ["is empty"]),
        (b'{"input_ids": [5, 6], "loss_mask": [1, 1]}\n', ["no usable samples", "fewer than 16 loss tokens"]),
    ],
)
def test_unusable_data_files(tmp_path, content, words):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    assert_clean_error(plan(TINY, data, tmp_path / "m"), tmp_path / "m", str(data), *words)
    assert_clean_error(
        plan(TINY, tmp_path / "none.jsonl", tmp_path / "m"), tmp_path / "m", "none.jsonl", "cannot read"
    )
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not data")  # a directory is data only if it holds some
    assert_clean_error(
        plan(TINY, tmp_path / "notes", tmp_path / "m"),
        tmp_path / "m",
        str(tmp_path / "notes"),
        "no *.jsonl, *.json or *.parquet files",
    )


# ---------------------------------------------------------------------------------------------- bad configs
BASE = tomllib.loads(TINY.read_text())
FIELDS = {
    s: {f.name: f.type for f in __import__("dataclasses").fields(c)} for s, c in _SECTION_CLASSES.items()
}
LENGTHS = [
    ("data", "max_len"),
    ("data", "token_budget"),
    ("data", "num_buckets"),
    ("train", "buffer_capacity"),
    ("train", "min_ready"),
    ("train", "grad_accum"),
    ("train", "microbatch_tokens"),
    ("extract", "window"),
    ("train", "checkpoint_every"),
    ("drafter", "block_size"),
    ("drafter", "num_hidden_layers"),
    ("train", "num_anchors"),
    ("extract", "max_attempts"),
    ("train", "keep_checkpoints"),
]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(v, "nan" if v != v else repr(v))
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_str(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return toml_str(v) if isinstance(v, str) else str(v)


def toml_str(s: str) -> str:
    """A TOML basic string (json.dumps would write astral characters as surrogate escapes, invalid TOML)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def render(cfg: dict) -> str:
    out = []
    for section, kv in cfg.items():
        if isinstance(kv, dict):
            out.append(f"[{section}]")
            out += [f"{k} = {toml_value(v)}" for k, v in kv.items()]
        else:
            out.insert(0, f"{section} = {toml_value(kv)}")
    return "\n".join(out) + "\n"


def wrong_value_for(tp):
    base = st.one_of(
        st.text(max_size=4),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(-5, 5),
        st.lists(st.integers(0, 3), max_size=2),
        st.dictionaries(st.sampled_from("ab"), st.integers(0, 2), min_size=1, max_size=2),
    )
    if tp in (int, "int"):
        return base.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool)))
    if tp in (float, "float"):
        return base.filter(lambda v: isinstance(v, (str, bool, list, dict)))
    if tp in (str, "str"):
        return base.filter(lambda v: not isinstance(v, str))
    if tp in (bool, "bool"):
        return base.filter(lambda v: not isinstance(v, bool))
    if str(tp) == "bool | str":  # is_causal: true, false or "auto"
        return base.filter(lambda v: not isinstance(v, bool) and v != "auto")
    if str(tp).startswith("dict"):  # a table: any other type (a table with unknown keys is another case)
        return base.filter(lambda v: not isinstance(v, dict))
    return base.filter(lambda v: not isinstance(v, list))  # list[int] / list[float] fields


@st.composite
def bad_config(draw) -> tuple[bytes, list[str], bool]:
    """(file bytes, words the error must contain, must_fail)."""
    cfg = json.loads(json.dumps(BASE))
    kind = draw(
        st.sampled_from(
            [
                "wrong_type",
                "unknown_key",
                "unknown_section",
                "huge",
                "negative",
                "non_finite",
                "non_utf8",
                "empty",
                "duplicate_key",
                "duplicate_section",
                "syntax",
                "section_not_table",
                "deep",
                "long_int",
                "mask_id",
            ]
        )
    )
    section = draw(st.sampled_from(sorted(FIELDS)))
    key = draw(st.sampled_from(sorted(FIELDS[section])))
    if kind == "wrong_type":
        cfg.setdefault(section, {})[key] = draw(wrong_value_for(FIELDS[section][key]))
        return render(cfg).encode(), [f"{section}.{key}", "expected"], True
    if kind == "unknown_key":
        name = draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in FIELDS[section]))
        cfg.setdefault(section, {})[name] = draw(st.integers(0, 9))
        return render(cfg).encode(), [f"{section}.{name}", "unknown key"], True
    if kind == "unknown_section":
        name = draw(st.from_regex(r"[a-z]{1,10}", fullmatch=True).filter(lambda k: k not in FIELDS))
        cfg[name] = {"x": 1}
        return render(cfg).encode(), [f"[{name}]", "unknown section"], True
    if kind == "huge":
        s, k = draw(st.sampled_from(LENGTHS))
        cfg.setdefault(s, {})[k] = draw(st.integers(2**62 + 1, 2**200))
        return render(cfg).encode(), [f"{s}.{k}", "out of range"], True
    if kind == "negative":
        s, k = draw(st.sampled_from(LENGTHS))
        cfg.setdefault(s, {})[k] = draw(st.integers(-(2**40), 0))
        return render(cfg).encode(), [f"{s}.{k}"], True
    if kind == "non_finite":
        s, k = draw(
            st.sampled_from(
                [
                    ("train", "lr"),
                    ("train", "gamma"),
                    ("train", "noise_std"),
                    ("train", "warmup_ratio"),
                    ("drafter", "rope_theta"),
                    ("train", "grad_clip"),
                ]
            )
        )
        cfg.setdefault(s, {})[k] = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
        return render(cfg).encode(), [f"{s}.{k}"], True
    if kind == "non_utf8":
        text = render(cfg).encode()
        at = draw(st.integers(0, len(text)))
        return (
            text[:at] + draw(st.sampled_from([b"\xff", b"\xc3(", b"\x80"])) + text[at:],
            ["not UTF-8"],
            True,
        )
    if kind == "empty":
        return b"", [], False  # an empty config means all defaults: valid
    if kind == "duplicate_key":
        text = render(cfg)
        lines = text.splitlines()
        i = draw(st.sampled_from([i for i, x in enumerate(lines) if " = " in x and not x.startswith("[")]))
        lines.insert(i + 1, lines[i])
        return ("\n".join(lines) + "\n").encode(), ["invalid TOML", f"line {i + 2}"], True
    if kind == "duplicate_section":
        text = render(cfg) + f"[{section}]\n"
        return text.encode(), ["invalid TOML", "line"], True
    if kind == "syntax":
        lines = render(cfg).splitlines()
        i = draw(st.integers(0, len(lines)))
        junk = draw(
            st.sampled_from(["= 1", "[unclosed", "key = ", 'k = "x', "a.b..c = 1", "[[x]", "k = 1 2"])
        )
        lines.insert(i, junk)
        return ("\n".join(lines) + "\n").encode(), ["invalid TOML", f"line {i + 1}"], True
    if kind == "section_not_table":
        cfg[section] = draw(st.integers(0, 9))
        return render(cfg).encode(), [section, "expected a table"], True
    if kind == "deep":
        n = draw(st.integers(1000, 50000))
        return ("x = " + "[" * n + "]" * n + "\n").encode(), ["invalid TOML"], True
    if kind == "long_int":
        s, k = draw(st.sampled_from(LENGTHS))
        cfg.setdefault(s, {})[k] = "@LONG@"
        digits = "7" * draw(st.integers(4301, 20000))
        return render(cfg).replace('"@LONG@"', digits).encode(), ["invalid TOML"], True
    assert kind == "mask_id"
    cfg["drafter"]["mask_token_id"] = draw(st.one_of(st.integers(VOCAB, 2**62), st.integers(-(2**62), -2)))
    return render(cfg).encode(), ["drafter.mask_token_id"], True


def _config_case(case):
    content, words, must_fail = case
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        data = d / "data.jsonl"
        data.write_text("".join(json.dumps(good_line(list(range(4 + i, 44 + i)))) + "\n" for i in range(3)))
        cfg = d / "cfg.toml"
        cfg.write_bytes(content)
        manifest = d / "manifest"
        res = plan(cfg, data, manifest)
        if not must_fail and res.exit_code == 0:
            return
        assert_clean_error(res, manifest, str(cfg) if must_fail else "", *words)


@FAST
@given(case=bad_config())
@example(case=(b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", ["invalid TOML"], True))
@example(case=(b"[train]\nlr = " + b"9" * 5000 + b"\n", ["invalid TOML"], True))
@example(case=(b"[train]\nlr = " + b"9" * 400 + b"\n", ["train.lr", "not a finite number"], True))
@example(case=(b"[train]\nlr = inf\n", ["train.lr", "not a finite number"], True))
@example(
    case=(
        b"[drafter]\nmask_token_id = 99999\n",
        ["drafter.mask_token_id", "outside the target vocabulary"],
        True,
    )
)
@example(case=(b'[data]\nbucket_edges = "\xf0\x90\x80\x80"\n', ["data.bucket_edges", "expected"], True))
def test_fuzz_config_files(case):
    _config_case(case)


@pytest.mark.slow
@SLOW
@given(case=bad_config())
def test_fuzz_config_files_slow(case):
    _config_case(case)


def test_huge_num_buckets_plans(tmp_path):
    """Regression: data.num_buckets near 2**62 tried to allocate that many quantiles (MemoryError)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(good_line(list(range(4, 24 + 3 * i)))) + "\n" for i in range(6)))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY.read_text().replace("num_buckets = 4", f"num_buckets = {2**62}"))
    res = plan(cfg, data, tmp_path / "m")
    assert res.exit_code == 0, res.output
    assert "buckets (length range: jobs per epoch)" in res.output
