"""Crashes lose nothing; damaged inputs get clear errors; parsers survive arbitrary input."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dipaco import checkpoint
from dipaco.config import TrainConfig, parse_override, resolve
from dipaco.errors import DipacoError
from dipaco.run import Run
from dipaco.train import train

from conftest import TINY_TRAIN, tiny_train_config

# Runs `dipaco train` in a child process whose safetensors writer SIGKILLs the process after
# `kill_after` module files: a crash in the middle of writing a checkpoint.
_KILLER = textwrap.dedent("""
    import os, signal, sys
    import safetensors.torch as st
    import dipaco.checkpoint as ck
    calls = {"n": 0}
    real = st.save_file
    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > int(os.environ["KILL_AFTER"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    ck.save_file = dying_save
    from dipaco.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _train_args(shards, out, rounds):
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    return ["train", "--shards", str(shards), "--out", str(out), "--quiet", "--rounds", str(rounds),
            "--inner-steps", "6", *sets]


def test_sigkill_during_checkpoint_write_then_resume_is_bit_identical(shards_2x2, tmp_path):
    straight = tmp_path / "straight"
    train(tiny_train_config(rounds=2, inner_steps=6), shards_2x2, straight, progress=False)

    crashed = tmp_path / "crashed"
    # 7 files per round (6 modules + outer state): die after round 0 and 1 and three files of round 2
    proc = subprocess.run([sys.executable, "-c", _KILLER, *_train_args(shards_2x2, crashed, 2)],
                          env={**__import__("os").environ, "KILL_AFTER": "17"}, capture_output=True, text=True)
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


def test_existing_run_is_not_overwritten(shards_2x2, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(rounds=1, inner_steps=2), shards_2x2, run, progress=False)
    before = (run / "checkpoints" / "round_1" / "modules" / "head.safetensors").read_bytes()
    with pytest.raises(DipacoError, match="already holds a run"):
        train(tiny_train_config(rounds=1, inner_steps=2), shards_2x2, run, progress=False)
    with pytest.raises(DipacoError, match="config 'model' differs"):
        train(tiny_train_config("model.num_layers=2", rounds=2, inner_steps=2), shards_2x2, run, resume=True, progress=False)
    assert (run / "checkpoints" / "round_1" / "modules" / "head.safetensors").read_bytes() == before


def test_grid_that_does_not_fit_the_model(shards_2x2, tmp_path):
    with pytest.raises(DipacoError, match="level_sizes"):
        train(tiny_train_config("grid.level_sizes=[1, 1]"), shards_2x2, tmp_path / "r", progress=False)
    with pytest.raises(DipacoError, match="does not match the shards' grid"):
        train(tiny_train_config('grid.shape="3"'), shards_2x2, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------- fuzzing
_keys = st.sampled_from(["rounds", "inner.lr", "model.hidden_size", "grid.private_blocks", "outer", "nope.x",
                         "eval.context_tokens", "preset", "grid.shape", "", "a..b"])
_values = st.one_of(st.integers(-5, 10**6).map(str), st.floats(allow_nan=True).map(repr), st.text(max_size=12),
                    st.sampled_from(["[1, 2]", "true", '"tiny"', "[", "{}", "inf", "nan"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_keys, _values), max_size=4))
def test_config_overrides_never_crash(pairs):
    try:
        resolve(TrainConfig, overrides=[f"{k}={v}" for k, v in pairs])
    except DipacoError:
        pass


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_override_parser_never_crashes(text):
    try:
        parse_override(text)
    except DipacoError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=200), st.binary(max_size=50).map(lambda b: b.decode("latin-1"))), max_size=6))
def test_router_handles_any_text(shards_2x2, texts):
    from dipaco.routing import Router

    router = _router_cache.setdefault("r", Router.load(shards_2x2 / "router"))
    routes = router.route(texts)
    assert len(routes) == len(texts) and set(routes) <= set(router.paths)


_router_cache: dict = {}
