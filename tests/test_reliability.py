"""Crashes lose nothing; damaged inputs get clear errors; parsers survive arbitrary input."""

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
import tomllib
import typing

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dipaco.config import TrainConfig, parse_override, resolve, to_dict
from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.storage.run import Run
from dipaco.training.train import train

from conftest import TINY_TRAIN, tiny_train_config

# Runs `dipaco train` in a child process whose safetensors writer SIGKILLs the process after
# `kill_after` module files: a crash in the middle of writing a checkpoint.
_KILLER = textwrap.dedent("""
    import os, signal, sys
    import safetensors.torch as st
    import dipaco.storage.checkpoint as ck
    calls = {"n": 0}
    real = st.save_file
    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > int(os.environ["KILL_AFTER"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    ck.save_file = dying_save
    from dipaco.cli.commands import main
    sys.exit(main(sys.argv[1:]))
""")


def _train_args(shards, out, rounds):
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    return ["train", "--shards", str(shards), "--out", str(out), "--quiet", "--rounds", str(rounds),
            "--inner-steps", "6", *sets]


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_then_resume_is_bit_identical(shards_2x2, tmp_path):
    straight = tmp_path / "straight"
    train(tiny_train_config(rounds=2, inner_steps=6), shards_2x2, straight, progress=False)

    crashed = tmp_path / "crashed"
    # 7 files per round (6 modules + outer state): die after round 0 and 1 and three files of round 2
    proc = subprocess.run([sys.executable, "-c", _KILLER, *_train_args(shards_2x2, crashed, 2)],
                          env={**__import__("os").environ, "KILL_AFTER": "17"}, capture_output=True, text=True,
                          timeout=600)  # a worker process that outlived its SIGKILLed trainer would hold the pipes
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert checkpoint.latest_round(crashed) == 1  # the half-written round 2 never became visible
    assert checkpoint.list_rounds(crashed) == [0, 1]

    assert list((crashed / "checkpoints").glob(".round_2.tmp-*"))  # what SIGKILL left behind...
    train(tiny_train_config(rounds=2, inner_steps=6), shards_2x2, crashed, resume=True, progress=False)
    assert not list((crashed / "checkpoints").glob(".round_*"))  # ...is cleaned up on resume
    a, b = checkpoint.load_modules(straight, 2), checkpoint.load_modules(crashed, 2)
    for m in a:
        for n in a[m]:
            assert torch.equal(a[m][n], b[m][n]), (m, n)


@pytest.mark.slow
def test_damaged_checkpoints_get_clear_errors(shards_2x2, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(rounds=1, inner_steps=3), shards_2x2, run, progress=False)
    module_file = run / "checkpoints" / "round_1" / "modules" / "embed.safetensors"
    data = module_file.read_bytes()
    module_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(DipacoError, match="corrupt or truncated"):
        Run(run).path_model("0-0", 1)
    module_file.write_bytes(b"not a safetensors file at all")
    with pytest.raises(DipacoError, match="corrupt or truncated"):
        checkpoint.load_modules(run, 1)
    module_file.unlink()
    with pytest.raises(DipacoError, match="missing"):
        checkpoint.load_modules(run, 1)
    (run / "checkpoints" / "latest").write_text("round_7\n")
    with pytest.raises(DipacoError, match="not a complete checkpoint"):
        checkpoint.latest_round(run)


@pytest.mark.slow
def test_existing_run_is_not_overwritten(shards_2x2, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(rounds=1, inner_steps=2), shards_2x2, run, progress=False)
    before = (run / "checkpoints" / "round_1" / "modules" / "head.safetensors").read_bytes()
    with pytest.raises(DipacoError, match="already holds a run"):
        train(tiny_train_config(rounds=1, inner_steps=2), shards_2x2, run, progress=False)
    with pytest.raises(DipacoError, match="config 'model' differs"):
        train(tiny_train_config("model.num_layers=2", rounds=2, inner_steps=2), shards_2x2, run, resume=True, progress=False)
    assert (run / "checkpoints" / "round_1" / "modules" / "head.safetensors").read_bytes() == before


@pytest.mark.slow
def test_grid_that_does_not_fit_the_model(shards_2x2, tmp_path):
    with pytest.raises(DipacoError, match="level_sizes"):
        train(tiny_train_config("grid.level_sizes=[1, 1]"), shards_2x2, tmp_path / "r", progress=False)
    with pytest.raises(DipacoError, match="does not match the shards' grid"):
        train(tiny_train_config('grid.shape="3"'), shards_2x2, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------- fuzzing
def _leaves(cls, prefix=""):
    """{dotted key: annotated type} of every leaf field of a config dataclass."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_leaves(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hints[f.name]
    return out


_LEAVES = _leaves(TrainConfig)
_words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_by_type = {int: st.one_of(st.integers(1, 64), st.integers(-5, 10**6)).map(str), float: st.floats(allow_nan=True).map(repr),
            bool: st.sampled_from(["true", "false"]), str: st.one_of(_words, _words.map(json.dumps)),
            list[int]: st.lists(st.integers(-2, 12), max_size=3).map(str)}


def _of_type(tp):
    """Values of a field's type as --set text; a Literal: one of its values, or a word that is none of them."""
    if typing.get_origin(tp) is typing.Literal:
        return st.one_of(st.sampled_from([json.dumps(v) for v in typing.get_args(tp)]), _words.map(json.dumps))
    return _by_type[tp]


# a real key with a value of its type (it may still fail validation: rounds=-3) ...
_typed = st.sampled_from(sorted(_LEAVES)).flatmap(lambda k: st.tuples(st.just(k), _of_type(_LEAVES[k])))
# ... or anything: sections, unknown keys, empty keys, values of the wrong type, text that is not TOML
_keys = st.sampled_from(["rounds", "inner.lr", "model.hidden_size", "grid.private_blocks", "outer", "nope.x",
                         "eval.context_tokens", "preset", "grid.shape", "", "a..b"])
_values = st.one_of(st.integers(-5, 10**6).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=12),
                    st.sampled_from(["[1, 2]", "true", '"tiny"', '"small"', "[", "{}", "inf", "nan"]))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_typed, st.tuples(_keys, _values)), max_size=4))
@example([("rounds", "7"), ("inner.lr", "0.01"), ("grid.private_blocks", "[0, 3]"), ("rounds", "8")])
@example([("preset", '"small"'), ("model.hidden_size", "512"), ("comm.bits", "4"), ("device", "cpu")])
@example([("outer", "{}"), ("inner", "{lr = 0.5}")])
def test_overrides_show_up_in_the_resolved_config_or_fail_cleanly(pairs):
    """Any list of --set overrides: a one-line DipacoError, or a config in which every override shows up (the
    last one of each key wins) and nothing else moved: defaults, then the chosen preset, then the overrides."""
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = resolve(TrainConfig, overrides=overrides)
    except DipacoError as exc:
        assert "\n" not in str(exc)
        return
    parsed = [parse_override(o) for o in overrides]  # they all parsed, or resolve would have failed
    presets = [p["preset"] for p in parsed if "preset" in p]
    expected = to_dict(resolve(TrainConfig, flags={"preset": presets[-1] if presets else None}))

    def put(node: dict, values: dict) -> None:  # a section given as a table ({} too) sets the keys it names
        for k, v in values.items():
            if isinstance(node[k], dict):
                put(node[k], v)
            else:
                node[k] = float(v) if isinstance(node[k], float) and isinstance(v, int) else v

    for p in parsed:
        put(expected, p)
    assert _same(to_dict(cfg), expected), overrides


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
@example("inner.lr = 3e-4")
@example("grid.private_blocks=[0, 3]")
def test_override_text_parses_to_its_key_or_fails_cleanly(text):
    """Any text: a one-line DipacoError, or one value nested under exactly the dotted key left of the first '='."""
    try:
        parsed = parse_override(text)
    except DipacoError as exc:
        assert "\n" not in str(exc)
        return
    node = parsed
    for part in text.split("=", 1)[0].strip().split("."):
        assert isinstance(node, dict) and list(node) == [part], (text, parsed)
        node = node[part]
    raw = text.split("=", 1)[1]
    if isinstance(node, str) and node != raw:  # not the text itself: then it was a TOML string
        assert tomllib.loads(f"v = {raw}")["v"] == node


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=200), st.binary(max_size=50).map(lambda b: b.decode("latin-1"))), max_size=6))
def test_router_handles_any_text(shards_2x2, texts):
    from dipaco.routing import Router

    router = _router_cache.setdefault("r", Router.load(shards_2x2 / "router"))
    routes = router.route(texts)
    assert len(routes) == len(texts) and set(routes) <= set(router.paths)


_router_cache: dict = {}
