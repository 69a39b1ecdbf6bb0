import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import tomli_w

from dipaco import command_config as CC
from dipaco import config as C
from dipaco.cli.commands import build_parser, main
from dipaco.cli.flags import field_docs, flag_fields, flag_name, flags_of, optional_of
from dipaco.shard_config import ShardConfig
from dipaco.config import PRESETS, TrainConfig, from_dict, parse_override, read_toml, resolve, to_dict, to_toml
from dipaco.errors import DipacoError


def test_precedence_defaults_preset_file_set_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('preset = "small"\nrounds = 3\n[inner]\nlr = 0.01\nbatch_size = 2\n')
    cfg = resolve(TrainConfig, f, ["inner.lr=0.02", "rounds=4"], {"rounds": 5, "inner_steps": None})
    assert cfg.preset == "small"
    assert cfg.model.hidden_size == PRESETS["small"]["model"]["hidden_size"]  # preset applied
    assert cfg.inner.batch_size == 2  # file beats preset
    assert cfg.inner.lr == 0.02  # --set beats file
    assert cfg.rounds == 5  # flag beats --set
    assert cfg.inner_steps == TrainConfig().inner_steps  # None flag leaves the default


def test_unknown_key_and_wrong_type_are_errors(tmp_path):
    with pytest.raises(DipacoError, match="unknown key 'inner.lrr'"):
        resolve(TrainConfig, overrides=["inner.lrr=1"])
    with pytest.raises(DipacoError, match="'rounds' must be int"):
        resolve(TrainConfig, overrides=['rounds="many"'])
    with pytest.raises(DipacoError, match="is a section"):
        resolve(TrainConfig, overrides=["inner=3"])
    with pytest.raises(DipacoError, match="must be > 0"):
        resolve(TrainConfig, overrides=["inner_steps=0"])
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = [\n")
    with pytest.raises(DipacoError, match="not valid TOML"):
        resolve(TrainConfig, bad)
    with pytest.raises(DipacoError, match="does not exist"):
        resolve(TrainConfig, tmp_path / "missing.toml")
    with pytest.raises(DipacoError, match="unknown preset"):
        resolve(TrainConfig, flags={"preset": "huge"})


def test_override_parsing():
    assert parse_override("a.b=3") == {"a": {"b": 3}}
    assert parse_override("grid.private_blocks=[0, 3]") == {"grid": {"private_blocks": [0, 3]}}
    assert parse_override("x=hello") == {"x": "hello"}  # not TOML: kept as a string
    with pytest.raises(DipacoError):
        parse_override("novalue")


@pytest.mark.parametrize("cls", [TrainConfig, ShardConfig])
def test_toml_round_trip(tmp_path, cls):
    cfg = resolve(cls)
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    assert to_dict(from_dict(cls, read_toml(f))) == to_dict(cfg)


def test_private_head_needs_an_untied_head():
    with pytest.raises(DipacoError, match="set model.tie_embeddings=false"):
        resolve(TrainConfig, overrides=["grid.private_head=true"])  # tied by default: the head is the embedding
    resolve(TrainConfig, overrides=["grid.private_head=true", "model.tie_embeddings=false"])
    resolve(TrainConfig, overrides=["grid.private_head=true", "grid.private_embedding=true"])  # tied, both private


# ------------------------------------------------------------------ flags generated from the dataclasses
COMMANDS = {"shard": ShardConfig, "train": C.TrainConfig, "eval": CC.EvalCommandConfig,
            "generate": CC.GenerateConfig, "reshard": CC.ReshardConfig, "fit-window-router": CC.WindowRouterConfig}


def _float_keys(cls, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = optional_of(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, f"{prefix}{f.name}.")
        elif tp is float:
            yield prefix + f.name


@pytest.mark.parametrize("cls,key", [(cls, key) for cls in COMMANDS.values() for key in _float_keys(cls)])
def test_float_settings_refuse_nan_and_infinity(cls, key):
    """Found by fuzzing: inner.lr=nan passed, as NaN passes every range check (each comparison is false)."""
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(DipacoError, match=f"^config: '{key}' must be a finite number, got {value}$"):
            resolve(cls, overrides=[f"{key}={value}"])


def _subparser(command):
    return build_parser()._subparsers._group_actions[0].choices[command]


def _owner(cls, key):
    for part in key.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_is_its_field_once(command):
    """A flag per flag() field, and nothing else config-like: its default, choices and help come from the field."""
    cls = COMMANDS[command]
    actions = {a.dest[len("cfg."):]: a for a in _subparser(command)._actions if a.dest.startswith("cfg.")}
    fields = {key: (f, tp) for key, f, tp in flag_fields(cls)}
    assert sorted(actions) == sorted(fields) and fields
    for key, (f, tp) in fields.items():
        a = actions[key]
        assert a.option_strings[0] == flag_name(f)
        assert a.default is None  # the default lives in the dataclass only; an unset flag is not applied
        doc = field_docs(_owner(cls, key))[f.name]
        assert a.help.startswith(doc.split(". ")[0].replace("%", "%%")[:40]), (key, a.help)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default not in (None, "", []) and not isinstance(default, bool):
            assert a.help.count(f"default: {default}") == 1, (key, a.help)
        inner, _ = optional_of(tp)
        if typing.get_origin(inner) is typing.Literal:  # and the old names it still takes, not shown in --help
            assert a.choices == list(typing.get_args(inner)) + list(f.metadata["renamed"])
            assert a.metavar == "{" + ",".join(map(str, typing.get_args(inner))) + "}"
        else:
            assert a.choices is None


def test_literals_match_their_sources():
    from dipaco.training.quant import SUPPORTED_BITS

    assert typing.get_args(C.Bits) == SUPPORTED_BITS
    assert typing.get_args(C.Preset) == tuple(C.PRESETS)


def _leaves(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        elif value is not None:
            yield prefix + f.name, value


def _another_value(value, tp):
    """A valid-looking value of the field's type that differs from ``value``."""
    inner, _ = optional_of(tp)
    if typing.get_origin(inner) is typing.Literal:
        return next(c for c in typing.get_args(inner) if c != value) if len(typing.get_args(inner)) > 1 else None
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if isinstance(value, str):
        return value + "x" if value else None
    return None


def _field_types(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _field_types(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name]


@pytest.mark.parametrize("cls", list(COMMANDS.values()))
def test_set_of_every_key_round_trips(cls, tmp_path):
    """Every key set to a value other than its default, by --set and by a TOML file, lands on that key with its
    type (or is refused by a cross-field check, one line): an ignored override cannot pass."""
    base, types = resolve(cls), dict(_field_types(cls))
    landed = 0
    for key, value in _leaves(base):
        other = _another_value(value, types[key])
        if other is None:
            continue
        text = tomli_w.dumps({"v": other})[len("v = "):].strip()
        try:
            cfg = resolve(cls, overrides=[f"{key}={text}"])
        except DipacoError as exc:  # a valid type that another setting rules out: the override was read
            assert "\n" not in str(exc), key
            continue
        got = dict(_leaves(cfg))
        assert got[key] == other and type(got[key]) is type(other), key
        if key != "preset":  # a preset sets the model's sizes: the one key meant to change others
            assert {k: v for k, v in got.items() if k != key} == {k: v for k, v in _leaves(base) if k != key}, key
        f = tmp_path / "c.toml"
        f.write_text(to_toml(cfg))
        assert to_dict(resolve(cls, f)) == to_dict(cfg), key
        landed += 1
    assert landed >= 2, f"only {landed} keys of {cls.__name__} could be changed"


def test_flags_land_on_their_keys():
    args = build_parser().parse_args(["train", "--shards", "s", "--out", "o", "--bits", "8", "--grid", "1",
                                      "--simulate-bandwidth", "100", "--set", "inner.lr=1e-3"])
    assert flags_of(args) == {"comm.bits": 8, "grid.shape": "1", "comm.simulate_mbit": 100.0}
    cfg = resolve(C.TrainConfig, None, args.overrides, flags_of(args))
    assert (cfg.comm.bits, cfg.grid.shape, cfg.inner.lr) == (8, "1", 1e-3)
    args = build_parser().parse_args(["eval", "--run", "r", "--shards", "s", "--out", "o.json", "--no-oracle",
                                      "--route-every", "64", "--route-every", "128"])
    assert flags_of(args) == {"oracle": False, "route_every": [64, 128]}
    args = build_parser().parse_args(["shard", "--data", "d", "--out", "o", "--no-spherical", "--features", "lm"])
    assert flags_of(args) == {"routing.spherical": False, "routing.features": "lm"}


def test_train_and_shard_name_their_engines_alike():
    engines = {command: next(a for a in _subparser(command)._actions if a.option_strings == ["--engine"])
               for command in ("train", "shard")}
    assert engines["shard"].choices == ["local", "ray"] and engines["shard"].default == "local"
    assert engines["train"].choices[:2] == ["local", "ray"] and TrainConfig().engine == "local"
    assert engines["train"].metavar == "{local,ray}"  # what --help offers: the old name is taken, not shown


@pytest.mark.parametrize("where", ["flag", "set", "file"])
def test_engine_sync_is_taken_as_local_with_one_warning(where, tmp_path, capsys, monkeypatch):
    from dipaco import settings

    monkeypatch.setattr(settings, "_warned", set())
    (tmp_path / "c.toml").write_text('engine = "sync"\n')
    argv = {"flag": ["--engine", "sync"], "set": ["--set", "engine=sync"], "file": ["--config", str(tmp_path / "c.toml")]}
    args = build_parser().parse_args(["train", "--shards", "s", "--out", "o", *argv[where]])
    cfg = resolve(TrainConfig, args.config, args.overrides, flags_of(args))
    resolve(TrainConfig, args.config, args.overrides, flags_of(args))  # once per process, however often it is read
    assert cfg.engine == "local"
    assert capsys.readouterr().err == "dipaco: warning: --engine sync is now called local\n"
    with pytest.raises(DipacoError, match="'engine' must be 'local' or 'ray', got 'synch'"):
        resolve(TrainConfig, overrides=["engine=synch"])


@pytest.mark.parametrize("argv,needle", [
    (["train", "--shards", "{t}/s", "--out", "{t}/o", "--set", "outer.momentum=1.5"], "'outer.momentum' must be in [0, 1)"),
    (["train", "--shards", "{t}/s", "--out", "{t}/o", "--set", "comm.bits=3"], "'comm.bits' must be 4, 8, 16 or 32, got 3"),
    (["train", "--shards", "{t}/s", "--out", "{t}/o", "--set", "inner.lr=nan"], "'inner.lr' must be a finite number, got nan"),
    (["shard", "--data", "{t}/d", "--out", "{t}/o", "--balance", "inf"], "'routing.balance' must be a finite number, got inf"),
    (["train", "--shards", "{t}/s", "--out", "{t}/o", "--fragments", "0"], "'streaming.fragments' must be >= 1, got 0"),
    (["shard", "--data", "{t}/d", "--out", "{t}/o", "--balance", "0.5"], "'routing.balance' must be 0 (off) or >= 1.0"),
    (["shard", "--data", "{t}/d", "--out", "{t}/o", "--set", "routing.assign=\"nearest\""],
     "'routing.assign' must be 'kmeans' or 'random', got 'nearest'"),
    (["eval", "--run", "{t}/r", "--shards", "{t}/s", "--out", "{t}/r.json", "--set", "temperature=0"],
     "'temperature' must be > 0"),
    (["eval", "--run", "{t}/r", "--shards", "{t}/s", "--out", "{t}/r.json", "--set", "split=\"test\""],
     "'split' must be 'heldout' or 'val'"),
    (["generate", "--run", "{t}/r", "--mixture", "1", "hello"], "a mixture needs K >= 2 paths"),
    (["generate", "--run", "{t}/r", "--set", "max_new_tokens=-1", "hello"], "'max_new_tokens' (--max-new-tokens) is -1: ask for at least 1 new token"),
    (["generate", "--run", "{t}/r", "--max-new-tokens", "0", "hello"], "'max_new_tokens' (--max-new-tokens) is 0: ask for at least 1 new token"),
    (["reshard", "--run", "{t}/r", "--shards", "{t}/s", "--out", "{t}/o", "--holdout-fraction", "1.5"],
     "'holdout_fraction' must be in (0, 1)"),
    (["reshard", "--run", "{t}/r", "--shards", "{t}/s", "--out", "{t}/o", "--set", "target=\"even\""],
     "'target' must be 'current' or 'uniform'"),
    (["fit-window-router", "--run", "{t}/r", "--shards", "{t}/s", "--window", "64", "--max-tokens", "0"],
     "'max_tokens' must be > 0, got 0"),
])
def test_a_bad_value_gets_its_sections_one_line_error(argv, needle, tmp_path, capsys):
    assert main([a.format(t=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dipaco {argv[0]}: error: config: ") and needle in err, err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_bad_choice_on_the_command_line_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--shards", "s", "--out", "o", "--bits", "3"])
    assert exc.value.code == 2
    assert "dipaco train: error: argument --bits: invalid choice: 3" in capsys.readouterr().err


def test_no_command_takes_an_abbreviated_flag(capsys):
    """argparse would read --prompt as --prompts-file, and --out-dir as --out: every dipaco parser refuses abbreviations."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert not parser.allow_abbrev and all(not p.allow_abbrev for p in subparsers.values())
    with pytest.raises(SystemExit) as exc:
        main(["train", "--shards", "s", "--out", "o", "--inner-step", "3"])  # --inner-steps, abbreviated
    assert exc.value.code == 2 and "unrecognized arguments: --inner-step" in capsys.readouterr().err


def test_every_parser_of_the_project_refuses_abbreviations():
    """The benchmarks' command lines too: every ArgumentParser(...) call in the repository says allow_abbrev=False."""
    root = Path(__file__).resolve().parents[1]
    for f in [*root.glob("dipaco/**/*.py"), *root.glob("bench/**/*.py"), *root.glob("eval/**/*.py"),
              *root.glob("routing/**/*.py"), *root.glob("sharding/**/*.py")]:
        for call in re.finditer(r"ArgumentParser\((.*?)\)\n", f.read_text(encoding="utf-8"), re.S):
            assert "allow_abbrev=False" in call.group(1), f"{f.relative_to(root)}: {call.group(0)[:80]}"


def test_generate_takes_prompts_as_words_flags_and_a_file(tmp_path):
    args = build_parser().parse_args(["generate", "--run", "r", "--prompt", "In the beginning...", "--prompt", "def f("])
    assert args.prompt == ["In the beginning...", "def f("] and args.words == [] and args.prompts_file is None
    args = build_parser().parse_args(["generate", "--run", "r", "two", "words", "--prompts-file", "p.txt"])
    assert args.words == ["two", "words"] and args.prompt == [] and args.prompts_file == "p.txt"
