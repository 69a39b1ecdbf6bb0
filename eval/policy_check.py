"""What the two saved routing rules share when read back: ``RUN/routing/once.json`` (``dipaco.eval.once_policy``) and
``RUN/window_routers/w<W>/policy.json`` (``dipaco.eval.window_policy``) are each read by their own module, through
these checks.

Every command reads them, so a file that is not a rule (invalid JSON, an unknown rule, a rule whose window router is
missing) is one line naming the file and the command that writes it again. That command's ``--overwrite`` may replace
the damaged file: ``dipaco.storage.outputs`` counts a run's policy folder that holds only its policy file as dipaco's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dipaco.errors import DipacoError


def read_object(f: Path, rewrite: str) -> dict:
    """The JSON object in ``f``; anything else is a one-line error that names ``rewrite``, the command to run."""
    if not f.is_file():
        raise damaged(f, "it is not a file", rewrite)
    try:
        content = json.loads(f.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise damaged(f, "it is not UTF-8 text", rewrite) from None
    except json.JSONDecodeError as exc:
        raise damaged(f, f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", rewrite) from None
    if not isinstance(content, dict):
        raise damaged(f, f"a JSON {type(content).__name__}, not an object", rewrite)
    return content


def damaged(f: Path, why: str, rewrite: str) -> DipacoError:
    return DipacoError(f"{f} is damaged ({why}); write it again with: {rewrite}")


def rule_problem(rule, kinds: tuple[str, ...]) -> str | None:
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
