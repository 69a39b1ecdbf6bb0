"""Where a run keeps its routing rules, and reading them back.

* ``RUN/routing/once.json``: the once rule (``dipaco.eval.once_policy``), written by ``dipaco choose-routing`` or by
  the first command that needed it (``perplexity.find_once_policy``);
* ``RUN/window_routers/w<W>/policy.json``: the every-W rule (``dipaco.eval.window_policy``), written by
  ``dipaco fit-window-router`` beside its window router.

Every command reads them here, so a file that is not a rule (invalid JSON, an unknown rule, a rule whose window router
is missing) is one line naming the file and the command that writes it again. That command's ``--overwrite`` may
replace the damaged file: ``dipaco.outputs`` counts a run's policy folder that holds only its policy file as dipaco's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dipaco.errors import DipacoError
from dipaco.eval.once_policy import ONCE_KINDS
from dipaco.eval.window_policy import RULE_KINDS
from dipaco.io import write_json
from dipaco.outputs import atomic_dir
from dipaco.run import Run


def once_policy_file(run: Run) -> Path:
    return run.root / "routing" / "once.json"


def window_router_dir(run: Run, w: int) -> Path:
    return run.root / "window_routers" / f"w{w}"


def policy_file(run: Run, w: int) -> Path:
    return window_router_dir(run, w) / "policy.json"


def choose_routing_again(run: Run, shards) -> str:
    return f"dipaco choose-routing --run {run.root} --shards {shards.root} --overwrite"


def fit_window_router_again(run: Run, shards, w: int) -> str:
    return f"dipaco fit-window-router --run {run.root} --shards {shards.root} --window {w} --overwrite"


def _read_object(f: Path, rewrite: str) -> dict:
    """The JSON object in ``f``; anything else is a one-line error that names ``rewrite``, the command to run."""
    if not f.is_file():
        raise _damaged(f, "it is not a file", rewrite)
    try:
        content = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise _damaged(f, "it is not UTF-8 text", rewrite) from None
    except json.JSONDecodeError as exc:
        raise _damaged(f, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", rewrite) from None
    if not isinstance(content, dict):
        raise _damaged(f, f"a JSON {type(content).__name__}, not an object", rewrite)
    return content


def _damaged(f: Path, why: str, rewrite: str) -> DipacoError:
    return DipacoError(f"{f} is damaged ({why}); write it again with: {rewrite}")


def _rule_problem(rule, kinds: tuple[str, ...]) -> str | None:
    """Why ``rule`` (the "chosen" entry of a policy) is not a rule of ``kinds``, or None."""
    if not isinstance(rule, dict):
        return "no rule under 'chosen'"
    if rule.get("kind") not in kinds:
        return f"unknown rule {rule.get('kind')!r}; known: {', '.join(kinds)}"
    margin, lookback = rule.get("margin", 0.0), rule.get("lookback", 0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        return f"the rule's margin {margin!r} is not a number"
    if isinstance(lookback, bool) or not isinstance(lookback, int) or lookback < 0:
        return f"the rule's lookback {lookback!r} is not a whole number >= 0"
    if not isinstance(rule.get("prior", False), bool):
        return f"the rule's prior {rule.get('prior')!r} is not true or false"
    return None


def read_once_policy(run: Run, shards) -> dict | None:
    """The once rule saved with the run (``source``: the file), or None when it has none."""
    f = once_policy_file(run)
    if not f.exists():
        return None
    rewrite = choose_routing_again(run, shards)
    policy = _read_object(f, rewrite)
    problem = _rule_problem(policy.get("chosen"), ONCE_KINDS)
    if problem is None and not (isinstance(policy.get("name"), str) and isinstance(policy.get("reason"), str)):
        problem = "no 'name' and 'reason' of the rule"
    if problem is not None:
        raise _damaged(f, problem, rewrite)
    return policy | {"source": str(f)}


def read_window_policy(run: Run, shards, w: int) -> dict | None:
    """The every-``w`` rule saved with the run (``dipaco fit-window-router``), or None when it has none. A rule that
    needs the window router needs its files beside it."""
    f = policy_file(run, w)
    if not f.exists():
        return None
    rewrite = fit_window_router_again(run, shards, w)
    policy = _read_object(f, rewrite)
    rules = [policy.get("chosen")] + ([policy["one_path"].get("chosen") if isinstance(policy["one_path"], dict) else None]
                                      if "one_path" in policy else [])
    problem = next((p for p in (_rule_problem(rule, RULE_KINDS) for rule in rules) if p), None)
    if problem is None and not isinstance(policy.get("reason"), str):
        problem = "no 'reason' of the rule"
    if problem is None and any(r["kind"] == "window-router" for r in rules) and not (f.parent / "router.json").is_file():
        problem = "its rule needs the window router, and router.json is missing"
    if problem is not None:
        raise _damaged(f, problem, rewrite)
    return policy


def stale_policy(saved: dict, once_name: str) -> str | None:
    """Why a saved every-W ``policy.json`` must not be followed, or None: one an earlier dipaco chose on the validation
    documents, or one chosen while routing once used another rule than ``once_name`` (its "stay" was another path)."""
    if saved.get("split") != "router_docs":
        return "was chosen on the validation documents (re-run dipaco fit-window-router --overwrite)"
    if saved.get("once_rule", "shard-router") != once_name:
        return f"was chosen when routing once used {saved.get('once_rule', 'shard-router')}"
    return None


def write_once_policy(run: Run, policy: dict, overwrite: bool = False) -> Path:
    """Save ``policy`` as RUN/routing/once.json, atomically (the folder is written whole, then renamed into place)."""
    f = once_policy_file(run)
    with atomic_dir(f.parent, overwrite=overwrite) as tmp:
        write_json(tmp / f.name, policy)
    return f
