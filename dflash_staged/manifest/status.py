"""``dflash status``: the human form of :meth:`dflash_staged.manifest.Manifest.status`."""

from __future__ import annotations

from dflash_staged.manifest.balance import format_balance, shares
from dflash_staged.manifest.states import group_counts


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def format_status(st: dict) -> str:
    """Human form of ``Manifest.status()``: a table of job states, a progress line, the hosts, and
    both sides' busy and idle shares with the bottleneck (:func:`.balance.format_balance`)."""
    jobs, total = st["jobs"], max(1, sum(st["jobs"].values()))
    rows = [f"{'state':<10}{'jobs':>10}{'share':>9}"]
    rows += [f"{k:<10}{n:>10,}{n / total:>9.1%}" for k, n in jobs.items()]
    g = group_counts(jobs)
    extracted, trained = g["extracted"], g["trained"]
    win = st["window"]
    rows.append(
        f"extracted {extracted:,}/{total:,} ({extracted / total:.1%}), trained {trained:,}/{total:,} "
        f"({trained / total:.1%}) over {st['epochs']} epoch(s); window {win['shards']} shards "
        f"{human_bytes(win['bytes'])}; extract {'done' if st['extract_done'] else 'running'}; "
        f"padding waste {st['padding_waste']:.2%}"
    )
    rows += format_store(st.get("store"))
    rows += format_reformations(st.get("reformations"))
    rows += format_hosts(st.get("hosts", []))
    rows += format_balance(st.get("balance"))
    rows += format_nodes(st.get("nodes"))
    return "\n".join(rows)


def format_reformations(events: list[dict] | None, last: int = 5) -> list[str]:
    """The trainer's re-formations (nodes left or came; torchrun's elastic restarts), the newest ``last``."""
    if not events:
        return []
    import time

    lines = [
        f"trainer re-formed {len(events)} time(s)" + (f"; the last {last}:" if len(events) > last else ":")
    ]
    for e in events[-last:]:
        what = [f"{', '.join(e['left'])} left"] if e.get("left") else []
        what += [f"{', '.join(e['came'])} came"] if e.get("came") else []
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["t"]))
        lines.append(
            f"  {when}: resumed from step {e['step']} on {e['ranks'][1]} rank(s) (were {e['ranks'][0]})"
            + (f"; {'; '.join(what)}" if what else "")
            + (f"; elastic restart {e['restart']}" if e.get("restart") else "")
        )
    return lines


def format_store(store: dict | None) -> list[str]:
    """The shards' bytes a token and what they hold (once extract has recorded the figure)."""
    if not store or not store["bytes_per_token"]:
        return []
    held = [
        "hidden states in FP8" if store["store_dtype"] != "target" else "hidden states in the target's dtype"
    ]
    held += ["the last layer"] if store["last_layer"] else []
    held += [f"the target's top-{store['topk']}"] if store["topk"] else []
    return [f"store: {store['bytes_per_token']:,} B a token ({', '.join(held)})"]


def format_nodes(nodes: dict | None) -> list[str]:
    """Node-local stores: one line per node (its window, shards ready for its ranks, both sides' shares
    over the run), and the starved node with the suggestion, if any."""
    if not nodes:
        return []
    lines = []
    for host, n in nodes["nodes"].items():
        sides = []
        for role in ("extract", "train"):
            s = (n["balance"] or {}).get(role)
            if s and sum(s["total"].values()) > 0:
                sides.append(
                    f"{role} " + ", ".join(f"{k[:-2]} {v:.0%}" for k, v in shares(s["total"]).items())
                )
        w = n["window"]
        lines.append(
            f"node {host}: window {w['shards']} shards {human_bytes(w['bytes'])}, {n['ready']} ready; "
            + ("; ".join(sides) or "no figures")
        )
    if nodes.get("imbalance"):
        lines.append(f"nodes: {nodes['imbalance']}")
    return lines


def format_hosts(hosts: list[dict]) -> list[str]:
    """One line per host: its processes (heartbeat age) and its workers' claims (lease left)."""
    lines = []
    for h in hosts:
        procs = (
            ", ".join(
                f"{p['role']} pid {p['pid']}"
                + (f" rank {p['rank']}" if p["rank"] is not None else "")
                + (
                    f" (heartbeat {p['heartbeat_age_s']:.0f} s ago)"
                    if p["heartbeat_age_s"] is not None
                    else ""
                )
                for p in h["processes"]
            )
            or "no live process"
        )
        claims = (
            "; ".join(
                f"{w['worker']} pid {w['pid']}: {len(w['jobs'])} claim(s), lease "
                + (f"{w['lease_left_s']:.0f} s left" if w["lease_left_s"] is not None else "none")
                for w in h["workers"]
            )
            or "no claims"
        )
        lines.append(f"host {h['host']}: {procs} | {claims}")
    return lines
