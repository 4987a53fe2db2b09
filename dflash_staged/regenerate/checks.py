"""Before ``dflash regenerate --server`` answers anything: each server answers, serves the target, and
renders the chat template as the project does. Every refusal is one line naming the server.

Contract:

* **Reachable.** ``GET /v1/models`` answers; a server that does not (or refuses the API key) is named.
* **The target.** A served model is the target when llama-server's metadata of it (``meta.n_vocab`` and
  ``meta.n_embd``, read from the GGUF file) equal the target config's vocabulary and hidden size; where
  there is no metadata (vLLM, SGLang), when its served name or path (``id``, ``root``) names the target:
  ``Qwen/Qwen3-8B``, ``/models/Qwen3-8B``, ``qwen3-8b.gguf`` and a hub cache's ``models--Qwen--Qwen3-8B``
  all name ``qwen3-8b``. ``--served-model NAME`` picks the served model by name instead (a server started
  with ``--served-model-name``); llama-server's metadata is still compared.
* **Capacity.** Conversations in flight per server: ``--concurrency``, else llama-server's ``total_slots``
  (``/props``), else SGLang's ``max_running_requests`` (``/get_server_info``), else
  :data:`~dflash_staged.regenerate.options.DEFAULT_CONCURRENCY`.
* **The template.** On a sample (the first-turn prompt of up to four conversations spread over the input,
  and the second-turn prompt of the first conversation that has one, with a placeholder answer), the
  prompt tokens the server will decode from are compared with the project's (the chat options' rendering
  with the generation prompt, tokenised without adding special tokens, as the in-process path does):
  llama-server's ``/apply-template`` then ``/tokenize`` (adding special tokens, as its chat endpoint does);
  vLLM's ``/tokenize`` with messages; else (SGLang) the prompt-token count of a one-token answer. The first
  difference is refused in one line saying where it is and what each side has there; a server that can
  do none of these gets a warning that its template was not checked.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import click

from dflash_staged.errors import DflashError
from dflash_staged.regenerate.client import Endpoint, RequestFailed
from dflash_staged.regenerate.options import DEFAULT_CONCURRENCY, GenOptions, ServerOptions

PLACEHOLDER = "OK."  # the answer standing in for the first one in the sampled second-turn prompt
SAMPLED = 4


class Served(NamedTuple):
    ep: Endpoint
    model: str  # the name requests carry
    concurrency: int
    template: str  # how the template was checked: "tokens", "count" or "unchecked"


def model_name(s: str) -> str:
    """What a model path, hub id or served name names (see the module docstring)."""
    s = s.strip().rstrip("/")
    m = re.search(r"models--[^/]+?--([^/]+)", s)
    base = (m.group(1) if m else s.rsplit("/", 1)[-1]).lower()
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def pick_model(url: str, listing: dict, target: str, dims, want: str | None) -> str:
    """The served model's name to request (see the module docstring); one line when none is the target."""
    entries = [e for e in listing.get("data") or [] if isinstance(e, dict) and e.get("id")]
    if not entries:
        raise DflashError(f"{url} serves no model (GET /v1/models lists none); is it still loading?")
    names = [e["id"] for e in entries]

    def shape_differs(e) -> str:
        meta = e.get("meta") or {}
        if dims is None or not meta.get("n_vocab") or not meta.get("n_embd"):
            return ""
        if (meta["n_vocab"], meta["n_embd"]) == (dims.vocab_size, dims.hidden_size):
            return ""
        return (
            f"vocabulary {meta['n_vocab']} and hidden size {meta['n_embd']} where the target {target} has "
            f"{dims.vocab_size} and {dims.hidden_size}"
        )

    if want is not None:
        e = next((e for e in entries if e["id"] == want), None)
        if e is None:
            raise DflashError(f"{url} does not serve --served-model {want!r}; it serves {names}")
        if shape_differs(e):
            raise DflashError(f"{url} serves {want!r} with {shape_differs(e)}: another model")
        return want
    ours = model_name(target)
    for e in entries:
        has_meta = bool((e.get("meta") or {}).get("n_vocab")) and dims is not None
        named = ours in (model_name(e["id"]), model_name(str(e.get("root") or "")))
        if (has_meta and not shape_differs(e)) or (not has_meta and named):
            return e["id"]
    why = "; ".join(f"{e['id']!r}: {shape_differs(e)}" for e in entries if shape_differs(e))
    raise DflashError(
        f"{url} serves {names}, not the target {target}"
        + (f" ({why})" if why else f" (by name: none is {ours!r})")
        + "; point --server at the target's server, or pass --served-model NAME if it serves the target "
        "under another name"
    )


def capacity(ep: Endpoint) -> int | None:
    """How many conversations the server batches, when it says so (see the module docstring)."""
    for path, keys in (("/props", ("total_slots",)), ("/get_server_info", ("max_running_requests",))):
        try:
            info = ep.get(path, timeout=30)
        except RequestFailed:
            continue
        states = info.get("internal_states")
        for src in (info, states[0] if isinstance(states, list) and states else {}):
            n = src.get(keys[0]) if isinstance(src, dict) else None
            if isinstance(n, int) and n > 0:
                return n
    return None


def probes(convs) -> list[tuple[int, list[dict]]]:
    """(input line, history ending in a user turn) of the sampled prompts (see the module docstring)."""
    step = max(1, len(convs) // SAMPLED)
    out = []
    for c in convs[::step][:SAMPLED]:
        first = next(i for i, t in enumerate(c.turns) if t["role"] == "user")
        out.append((c.line, c.turns[: first + 1]))
    for c in convs:
        users = [i for i, t in enumerate(c.turns) if t["role"] == "user"]
        if len(users) > 1:
            hist = c.turns[: users[0] + 1] + [{"role": "assistant", "content": PLACEHOLDER}]
            out.append((c.line, hist + c.turns[users[0] + 1 : users[1] + 1]))
            break
    return out


def _server_tokens(ep: Endpoint, model: str, msgs: list[dict], kwargs: dict, how: str | None):
    """(how, the server's prompt tokens or their count); ``how`` None: find the first way that works."""
    kw = {"chat_template_kwargs": kwargs} if kwargs else {}
    if how in (None, "llama"):
        try:
            prompt = ep.post("/apply-template", {"messages": msgs, **kw}, timeout=60)["prompt"]
            body = {"content": prompt, "add_special": True, "parse_special": True}
            return "llama", list(ep.post("/tokenize", body, timeout=60)["tokens"])
        except (RequestFailed, KeyError, TypeError) as e:
            if how or (isinstance(e, RequestFailed) and e.kind not in ("missing", "refused")):
                raise
    if how in (None, "vllm"):
        body = {"model": model, "messages": msgs, "add_generation_prompt": True, "add_special_tokens": False}
        try:
            return "vllm", list(ep.post("/tokenize", {**body, **kw}, timeout=60)["tokens"])
        except (RequestFailed, KeyError, TypeError) as e:
            if how or (isinstance(e, RequestFailed) and e.kind not in ("missing", "refused")):
                raise
    body = {"model": model, "messages": msgs, "max_tokens": 1, "temperature": 0.0, **kw}
    n = (ep.post("/v1/chat/completions", body, timeout=600).get("usage") or {}).get("prompt_tokens")
    return ("count", int(n)) if isinstance(n, int) else ("unchecked", None)


def _difference(tok, ours: list[int], theirs: list[int]) -> str:
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def text(ids: list[int]) -> str:
        return repr(tok.decode(ids)) if ids else "(the end)"

    return (
        f"at token {k}, after {text(ours[max(0, k - 6) : k])}, the server has {text(theirs[k : k + 3])} "
        f"(ids {theirs[k : k + 3]}) where the project has {text(ours[k : k + 3])} (ids {ours[k : k + 3]})"
    )


def check_template(ep: Endpoint, model: str, tok, o: GenOptions, sample) -> str:
    """Compare the prompts of ``sample`` (:func:`probes`); returns how they were compared."""
    how = None
    for line, msgs in sample:
        try:
            ours = list(tok(o.chat.render(tok, msgs, gen=True), add_special_tokens=False)["input_ids"])
        except Exception as e:  # noqa: BLE001 - a template error is the user's to fix, in one line
            raise DflashError(
                f"the project's chat template failed on line {line} ({type(e).__name__}: {e})"
            ) from None
        how, theirs = _server_tokens(ep, model, msgs, o.chat.kwargs, how)
        if how == "unchecked":
            return how
        opts = " and --chat-template-kwargs" if o.chat.kwargs else ""
        fix = (
            "; serve the target with the chat template the project renders (the tokenizer's, or the file of "
            f"--chat-template or [data] chat_template){opts}, or give the project the server's"
        )
        turn = "the first" if msgs[-1] is next(t for t in msgs if t["role"] == "user") else "a later"
        where = f"{ep.url} renders {turn} prompt of line {line} differently from the project"
        if how == "count" and theirs != len(ours):
            raise DflashError(f"{where}: {theirs} prompt tokens where the project has {len(ours)}{fix}")
        if how != "count" and theirs != ours:
            raise DflashError(f"{where}: {_difference(tok, ours, theirs)}{fix}")
    return "count" if how == "count" else "tokens"


def connect(o: GenOptions, s: ServerOptions, tok, convs, api_key: str | None) -> list[Served]:
    """Every server checked (see the module docstring), in the order given."""
    from dflash_staged.model.target.dims import target_dims

    try:
        dims = target_dims(o.target, local_only=True)
    except DflashError:
        dims = None  # a hub id not in the local cache: compare by name only
    sample, out = probes(convs), []
    for url in s.urls:
        ep = Endpoint(url, api_key, s.request_timeout_s)
        try:
            model = pick_model(ep.url, ep.get("/v1/models", timeout=30), o.target.model, dims, s.served_model)
            n = s.concurrency or capacity(ep) or DEFAULT_CONCURRENCY
            how = check_template(ep, model, tok, o, sample)
        except RequestFailed as e:
            hint = {
                "down": "; start it, or check the URL",
                "auth": f"; check the key in ${s.api_key_env}" if s.api_key_env else "; set --api-key-env",
            }
            raise DflashError(f"cannot use --server {ep.url}: {e}{hint.get(e.kind, '')}") from None
        if how == "unchecked":
            click.echo(
                f"regenerate: warning: {ep.url} cannot tokenise a chat, so its chat template was not "
                "compared with the project's",
                err=True,
            )
        out.append(Served(ep, model, n, how))
    return out
