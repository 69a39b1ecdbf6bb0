"""Command-line flags generated from config dataclasses (config.py declares them with settings.flag), and the parser
every dipaco command is built with (``Parser``: no abbreviated flags; ``config_args``: --config and --set).

A field declared ``flag(default)`` is also the flag ``--<name with dashes>`` (or the name given). Its help is
the first sentence of the field's docstring, then its default and, where the flag's name differs from it, its
dotted key (the name ``--set`` and TOML files use); its choices are its ``Literal`` values; a bool is
``--x/--no-x``; a list is repeatable. An unset flag stays None and is not applied, so precedence stays
defaults < preset < file < --set < flags (config.resolve).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing

from dipaco.settings import optional_of

FLAG_DEST = "cfg."  # argparse dest of a generated flag: "cfg." + the field's dotted key


def flag_name(f: dataclasses.Field) -> str:
    name = f.metadata["flag"]
    return name if isinstance(name, str) else "--" + f.name.replace("_", "-")



# ------------------------------------------------------------------------------ command line
@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: docstring} of a dataclass, read from its source (the string literal under each field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _first_sentence(doc: str) -> str:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", doc, maxsplit=1)[0]


def _shown(value) -> str | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def flag_fields(cls, prefix: str = ""):
    """(dotted key, field, type) of every ``flag()`` field of ``cls`` and its sections, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from flag_fields(tp, f"{prefix}{f.name}.")
        elif "flag" in f.metadata:
            yield prefix + f.name, f, tp


def _owner(cls, key: str):
    *sections, _ = key.split(".")
    hints = typing.get_type_hints(cls)
    for part in sections:
        cls = hints[part]
        hints = typing.get_type_hints(cls)
    return cls


def add_flags(parser: argparse.ArgumentParser, cls, only: tuple[str, ...] = (), show_defaults: bool = True) -> None:
    """One flag per ``flag()`` field of ``cls`` (``only``: these keys); unset flags stay None (not applied)."""
    for key, f, tp in flag_fields(cls):
        if only and key not in only:
            continue
        help_text = _first_sentence(field_docs(_owner(cls, key)).get(f.name, ""))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        notes = [f"key {key}"] if key != flag_name(f)[2:].replace("-", "_") else []  # the name --set and TOML use
        if show_defaults and _shown(default) is not None:
            notes.insert(0, f"default: {_shown(default)}")
        if notes:
            help_text += f" ({'; '.join(notes)})"
        kw: dict = {"dest": FLAG_DEST + key, "default": None, "help": help_text.replace("%", "%%")}
        tp, _ = optional_of(tp)
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is typing.Literal:
            current = list(typing.get_args(tp))
            kw["choices"], kw["type"] = current + list(f.metadata.get("renamed", {})), type(current[0])
            kw["metavar"] = "{" + ",".join(map(str, current)) + "}"  # the old names are accepted, not offered
        elif typing.get_origin(tp) is list:
            kw["action"], kw["type"] = "append", typing.get_args(tp)[0]
        else:
            kw["type"] = tp
        if "metavar" not in kw and tp is not bool:
            kw["metavar"] = f.metadata.get("metavar") or flag_name(f)[2:].upper().replace("-", "_")
        parser.add_argument(flag_name(f), **kw)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a line never breaks inside a flag name such as --grid."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def flags_of(args: argparse.Namespace) -> dict:
    """{dotted key: value} of the generated flags given on the command line."""
    return {k[len(FLAG_DEST):]: v for k, v in vars(args).items() if k.startswith(FLAG_DEST) and v is not None}


class Parser(argparse.ArgumentParser):
    """Every dipaco parser: our help layout, and no abbreviated flags (argparse would take --prompt for --prompts-file,
    and a later flag that shares a prefix would silently change what an old command line means)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, allow_abbrev=False, **kwargs)


def config_args(p: argparse.ArgumentParser, cls, func, example: str) -> None:
    """The flags generated from ``cls``'s fields, then --config FILE and --set KEY=VALUE for every other key;
    ``func`` runs the command."""
    p.set_defaults(func=func)
    add_flags(p, cls)
    p.add_argument("--config", help="TOML file with config keys (defaults < preset < file < --set < flags)")
    set_arg(p, example)


def set_arg(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one config value, e.g. --set {example} (repeatable)")
