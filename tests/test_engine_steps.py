"""The steps every training engine shares (dipaco.training.engine_steps): one definition each, what they compute
(fast tier)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch

from conftest import tiny_train_config
from dipaco.model.path_model import init_modules, llama_config
from dipaco.storage.run import build_grid, initial_modules
from dipaco.training.engine_steps import inner_record, rescale_and_step, round_line
from dipaco.training.outer import OuterOptimizer

SHARDS = SimpleNamespace(vocab_size=97, eos_token_id=0)


def test_inner_record_only_on_logged_steps():
    cfg = tiny_train_config("log_every=2")
    trainee = SimpleNamespace(step=3, index=1, path="0-1",
                              optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]))
    assert inner_record(cfg, trainee, 1, 2.5) is None
    trainee.step = 4
    assert inner_record(cfg, trainee, 1, 2.5) == {"kind": "inner", "round": 1, "step": 4, "trainee": 1, "path": "0-1",
                                                  "loss": 2.5, "lr": 1e-3}
    assert inner_record(tiny_train_config("log_every=0"), trainee, 1, 2.5) is None


def _outer(value: float) -> tuple[OuterOptimizer, dict[str, torch.Tensor]]:
    weights = {"w": torch.full((3,), value)}
    return OuterOptimizer({"m": weights}, lr=0.7, momentum=0.9, nesterov=True), weights


def test_rescale_and_step_is_the_rescaling_then_the_nesterov_step():
    outer, weights = _outer(1.0)
    rescale_and_step(outer, "m", {"w": torch.full((3,), 0.5)}, sqrt=True, paths_through=4)
    plain, plain_weights = _outer(1.0)
    plain.step("m", {"w": torch.full((3,), 0.5 * math.sqrt(4))})  # √P rescaling: the average times √(paths through m)
    assert torch.equal(weights["w"], plain_weights["w"]) and not torch.equal(weights["w"], torch.ones(3))
    outer, weights = _outer(1.0)
    rescale_and_step(outer, "m", {"w": torch.full((3,), 0.5)}, sqrt=False, paths_through=4)
    plain, plain_weights = _outer(1.0)
    plain.step("m", {"w": torch.full((3,), 0.5)})
    assert torch.equal(weights["w"], plain_weights["w"])


def test_round_line_has_the_shared_fields_then_the_engine_s_own():
    line = round_line(3, [2.0, 4.0], {"0-0": 1.0, "0-1": 3.0}, 2.0, 100, 2, 10, 20, compute_s=1.5)
    assert list(line) == ["kind", "round", "train_loss", "train_loss_by_trainee", "val_loss", "val_loss_mean", "seconds",
                          "tokens", "tokens_per_s", "workers", "bytes_sent", "bytes_received", "compute_s"]
    assert line["train_loss"] == 3.0 and line["val_loss_mean"] == 2.0 and line["tokens_per_s"] == 50.0
    dropped = round_line(1, [None, 5.0], {}, 0.0, 0, 4, 0, 0, engine="ray", dropped=[0])
    assert list(dropped)[:3] == ["kind", "round", "engine"] and list(dropped)[-1] == "dropped"
    assert dropped["train_loss"] == 5.0 and dropped["val_loss_mean"] is None and dropped["tokens_per_s"] is None
    assert round_line(1, [None], {}, 1.0, 0, 1, 0, 0)["train_loss"] is None


def test_initial_modules_are_the_seeded_dense_model_and_keep_only_what_is_asked():
    cfg = tiny_train_config()
    grid = build_grid(cfg, "2x2")
    every = init_modules(grid, llama_config(cfg.model, SHARDS.vocab_size, SHARDS.eos_token_id), cfg.seed)
    modules, counts = initial_modules(cfg, grid, SHARDS, grid.paths[0])
    assert modules.keys() == every.keys()
    assert all(torch.equal(t, every[m][n]) for m, ts in modules.items() for n, t in ts.items())
    some = set(list(every)[:2])
    kept, kept_counts = initial_modules(cfg, grid, SHARDS, grid.paths[0], keep=some)
    assert kept.keys() == some and kept_counts == counts  # the counts are of the whole run, whatever a worker keeps
    assert counts["total"] == sum(t.numel() for ts in every.values() for t in ts.values())
    assert counts["per_path"] == sum(t.numel() for m in grid.path_modules(grid.paths[0]) for t in every[m].values())


def test_both_engines_call_the_shared_steps_and_nothing_else_builds_them():
    """Each shared step is defined once (training/engine_steps.py, training/phase.py, storage/run.py) and called by the
    in-process engine (training/local_workers.py, training/train.py, training/sync.py) and the Ray engine
    (taskqueue/phases.py, taskqueue/newrun.py); the inner step and its record are taken in one place (the one phase),
    and no other file writes a round or inner line by hand."""
    from pathlib import Path

    core = Path(__file__).resolve().parents[1] / "dipaco"
    text = {f.relative_to(core).as_posix(): f.read_text(encoding="utf-8") for f in core.rglob("*.py")}
    train, sync, local = "training/train.py", "training/sync.py", "training/local_workers.py"
    phase, phases, runstore = "training/phase.py", "taskqueue/phases.py", "taskqueue/newrun.py"
    calls = {"train_phase(": ({local}, {phases}), "rescale_and_step(": ({sync}, {phases}),
             "validation_windows(": ({train}, {phases}), "initial_modules(": ({train}, {runstore}),
             "reusable_model(": ({local}, {phases})}
    for call, (in_process, ray) in calls.items():
        callers = {name for name, t in text.items() if call in t.replace(f"def {call}", "")}
        assert in_process <= callers and ray <= callers, (call, callers)
        assert sum(t.count(f"def {call}") for t in text.values()) == 1, call
    for call in ("inner_step(", "inner_record(", "fixed_windows("):  # one caller: the one phase
        callers = {name for name, t in text.items() if call in t.replace(f"def {call}", "")}
        assert callers == {phase}, (call, callers)
    assert {name for name, t in text.items() if "round_line(" in t.replace("def round_line(", "")} >= {"training/round_log.py"}
    for name, t in text.items():  # a line built by hand (a docstring may name one: ``kind="round"``)
        if name != "training/engine_steps.py":
            assert not re.search(r'(?<!`)kind="(round|inner)"', t), name
