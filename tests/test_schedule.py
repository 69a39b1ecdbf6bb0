"""The lr schedule's length is fixed when a run is created: extending a finished run keeps its past."""

import json

import pytest

from dipaco.errors import DipacoError
from dipaco.storage import checkpoint
from dipaco.training.train import train
from dipaco.training.phase import lr_at

from conftest import tiny_train_config

H = 4


def _inner_lrs(run) -> dict[tuple[int, int], float]:
    """(trainee, step) -> the lr that step used, from the 'inner' lines of metrics.jsonl."""
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["trainee"], r["step"]): r["lr"] for r in lines if r["kind"] == "inner"}


def test_lr_after_the_schedule_stays_at_the_final_value():
    inner = tiny_train_config().inner
    final = inner.lr * inner.min_lr_ratio
    assert final < lr_at(19, 20, inner) < 1.1 * final  # the last planned step, nearly there
    assert lr_at(20, 20, inner) == lr_at(35, 20, inner) == pytest.approx(final)


@pytest.mark.slow
def test_extending_a_finished_run_keeps_its_lr_schedule(shards_2x2, tmp_path):
    run = tmp_path / "run"
    sets = ("val_batches=0", "log_every=1")
    train(tiny_train_config(*sets, rounds=2, inner_steps=H), shards_2x2, run, progress=False)
    planned = _inner_lrs(run)  # a run planned for 2 rounds
    assert json.loads((run / "run.json").read_text())["schedule_steps"] == 2 * H
    cfg = tiny_train_config(*sets, rounds=4, inner_steps=H)
    train(cfg, shards_2x2, run, resume=True, progress=False)
    extended = _inner_lrs(run)
    assert {k: v for k, v in extended.items() if k[1] <= 2 * H} == planned  # the steps already taken are untouched
    final = cfg.inner.lr * cfg.inner.min_lr_ratio
    for (trainee, step), lr in extended.items():
        assert lr == lr_at(step - 1, 2 * H, cfg.inner)  # the schedule of the run as created
        if step > 2 * H:
            assert lr == pytest.approx(final)  # the extension runs at the final lr...
            assert lr < lr_at(step - 1, 4 * H, cfg.inner)  # ...not on a cosine re-stretched over 4 rounds
    assert {step for _, step in extended} == set(range(1, 4 * H + 1))
    assert checkpoint.list_rounds(run) == [0, 1, 2, 3, 4]
    rounds = [json.loads(l)["round"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in l[:20]]
    assert rounds == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_resume_with_other_inner_steps_is_refused(shards_2x2, tmp_path):
    """A round's global steps and the trainees' step counters must keep lining up."""
    run = tmp_path / "run"
    train(tiny_train_config("val_batches=0", "log_every=1", rounds=1, inner_steps=H), shards_2x2, run, progress=False)
    with pytest.raises(DipacoError, match="config 'inner_steps' differs"):
        train(tiny_train_config(rounds=3, inner_steps=2 * H), shards_2x2, run, resume=True, progress=False)
