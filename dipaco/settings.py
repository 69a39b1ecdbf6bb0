"""Dataclass sections as settings: values checked against field types, nested dicts, ``key=value`` overrides, TOML.

Generic: it knows no dipaco section and imports nothing of the project, so config.py can stand on it. A bad
key or value raises SettingError with the one-line message the user will see; config.py hands it on as a
DipacoError.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tomllib
import types
import typing
from pathlib import Path

import tomli_w


class SettingError(ValueError):
    """A key or value that does not fit the declared sections (config.py re-raises it as a DipacoError)."""


def flag(default, name: str = "", *, metavar: str | None = None, renamed: dict[str, str] | None = None):
    """A field that is also a command-line flag (flags.py makes it): ``name``, default ``--<field name with dashes>``;
    ``renamed``: {old value: its new name}, old values a user may still write (each taken with a one-line warning)."""
    meta = {"flag": name or True, "metavar": metavar, "renamed": dict(renamed or {})}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def optional_of(tp):
    """(inner type, True) for ``X | None``, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def one_of(values) -> str:
    """'a', 'b' or 'c' (numbers without quotes)."""
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _describe(tp) -> str:
    tp, _ = optional_of(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return one_of(typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def coerce(value, tp, key: str):
    """Check (and gently convert: an int where a float is wanted) a value against a field's annotated type."""
    tp, optional = optional_of(tp)
    if value is None and optional:
        return None
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, list):
            return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            # NaN passes every range check (each comparison is false), so it is refused here, with infinity
            raise SettingError(f"config: '{key}' must be a finite number, got {value!r}")
    elif tp is str:
        if isinstance(value, str):
            return value
    raise SettingError(f"config: '{key}' must be {_describe(tp)}, got {value!r}")


# ------------------------------------------------------------------------- dicts and overrides
_warned: set[str] = set()


def current_name(f: dataclasses.Field, value):
    """``value`` under its current name: a renamed value of ``f`` is replaced, with a warning once per process
    (configs and scripts written with the old name keep working while they are updated)."""
    new = f.metadata.get("renamed", {}).get(value) if isinstance(value, str) else None
    if new is None:
        return value
    name = f.metadata["flag"] if isinstance(f.metadata.get("flag"), str) else "--" + f.name.replace("_", "-")
    warning = f"dipaco: warning: {name} {value} is now called {new}"
    if warning not in _warned:
        _warned.add(warning)
        print(warning, file=sys.stderr)
    return new


def apply_dict(obj, values: dict, prefix: str = "") -> None:
    """Set fields of dataclass ``obj`` from a nested dict; unknown keys are errors."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise SettingError(f"config: unknown key '{full}' (known here: {', '.join(sorted(fields))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise SettingError(f"config: '{full}' is a section; write it as [{full}] with keys")
            apply_dict(current, value, f"{full}.")
        else:
            setattr(obj, key, coerce(current_name(fields[key], value), hints[key], full))


def nest(flat: dict) -> dict:
    """{"a.b": v} -> {"a": {"b": v}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *sections, last = key.split(".")
        for part in sections:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def parse_override(text: str) -> dict:
    """``a.b=value`` -> {"a": {"b": value}}; the value is read as TOML, else as a plain string."""
    if "=" not in text:
        raise SettingError(f"--set {text!r}: write it as section.key=value, e.g. --set inner.lr=1e-3")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise SettingError(f"--set {text!r}: the key is empty; write section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return nest({key: value})


# ------------------------------------------------------------------------------------ checks
def validate(cfg, at: str = "") -> None:
    """Every section checks itself (inner sections first, then the one that holds them)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, f"{at}{f.name}.")
    if hasattr(cfg, "check"):
        cfg.check(at)


def positive(key: str, value) -> None:
    if value <= 0:
        raise SettingError(f"config: '{key}' must be > 0, got {value}")


def at_least(key: str, value, low) -> None:
    if value < low:
        raise SettingError(f"config: '{key}' must be >= {low}, got {value}")


def fraction(key: str, value) -> None:
    if not 0.0 <= value < 1.0:
        raise SettingError(f"config: '{key}' must be in [0, 1), got {value}")


# ---------------------------------------------------------------------------------- TOML files
def read_parsed(path: str | Path, parse, parse_error: type[Exception], missing: str, invalid: str,
                error: type[Exception] = SettingError):
    """``parse`` of a UTF-8 text file (TOML here, JSON in io.py); a missing or unreadable file raises ``error``
    with the message ``missing`` or ``invalid`` (formatted with ``path`` and ``exc``)."""
    path = Path(path)
    if not path.is_file():
        raise error(missing.format(path=path))
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (parse_error, UnicodeDecodeError) as exc:
        raise error(invalid.format(path=path, exc=exc)) from None


def read_toml(path: str | Path) -> dict:
    return read_parsed(path, tomllib.loads, tomllib.TOMLDecodeError,
                       "config file {path} does not exist; pass an existing TOML file to --config",
                       "config file {path} is not valid TOML ({exc}); fix the file")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(cls, values: dict):
    cfg = cls()
    apply_dict(cfg, values)
    return cfg


def _without_none(values: dict) -> dict:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in values.items() if v is not None}


def to_toml(cfg) -> str:
    """A config as TOML (scalars first, then one table per section); unset (None) values are left out."""
    return tomli_w.dumps(_without_none(to_dict(cfg)))
