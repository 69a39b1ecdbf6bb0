"""Trackers (--log-to tensorboard,wandb): the round records as scalars, read back with TensorBoard's own reader and
from W&B's offline run files; a resumed run continues the same tracker run with every round once."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time

import pytest

from dipaco.config import TrainConfig, resolve
from dipaco.errors import DipacoError
from dipaco.training.engine_steps import round_line
from dipaco.training.tracker_backends import require
from dipaco.training.trackers import NORMS, round_scalars
from tracker_readers import tensorboard_scalars, wandb_runs

PATHS = ["0-0", "0-1", "1-0", "1-1"]
NORMED = {"L0.E0": {"outer_grad_norm": 2.0, "update_norm": 1.5, "momentum_norm": 3.0}}


def test_a_sync_round_record_gives_every_path_s_loss_and_perplexity_and_every_module_s_norms():
    record = round_line(3, [4.0, 5.0, 6.0, 7.0], {"0-0": 3.0, "1-1": 4.0}, seconds=2.0, tokens=1000, workers=2,
                        bytes_sent=64, bytes_received=32, wait_s=0.25, module_norms=NORMED)
    values = round_scalars(record, PATHS)
    assert {values[f"train_loss/{p}"] for p in PATHS} == {4.0, 5.0, 6.0, 7.0} and values["train_loss/mean"] == 5.5
    assert values["val_ppl/0-0"] == pytest.approx(math.exp(3.0)) and "val_ppl/0-1" not in values
    assert {values[f"{n}/L0.E0"] for n in NORMS} == {2.0, 1.5, 3.0}
    assert (values["speed/tokens_per_s"], values["comm/bytes_sent"], values["comm/wait_s"], values["workers/present"]) \
        == (500.0, 64.0, 0.25, 2.0)
    assert not any(k.startswith("phases/") for k in values)  # the Ray engine's alone


def test_a_ray_round_record_counts_retried_dropped_and_replayed_phases_and_leaves_a_dropped_loss_out():
    phases = [{"trainee": 0, "replayed": 2}, {"trainee": 1, "dropped": True}, {"trainee": 2, "replayed": 0},
              {"trainee": 3}]
    record = round_line(2, [4.0, None, 6.0, 8.0], {}, 1.0, 10, 3, 0, 0, engine="ray", dropped=[1], retried=[0, 3],
                        phases=phases)
    values = round_scalars(record, PATHS)
    assert (values["phases/retried"], values["phases/dropped"], values["phases/replayed"]) == (2.0, 1.0, 1.0)
    assert "train_loss/0-1" not in values and values["train_loss/1-1"] == 8.0  # never a zero for a missing loss
    assert not any(k.startswith("val_ppl/") for k in values)  # validation off: nothing, not zeros


def test_several_trainees_of_one_path_give_the_path_their_mean_loss():
    record = round_line(1, [2.0, 4.0, None], {}, 1.0, 10, 1, 0, 0)
    assert round_scalars(record, ["0", "0", "0"])["train_loss/0"] == 3.0


def test_log_to_takes_any_subset_and_names_the_choices_when_wrong():
    assert resolve(TrainConfig, flags={"log.to": "tensorboard,wandb"}).log.trackers == ["tensorboard", "wandb"]
    assert resolve(TrainConfig, overrides=['log.to="wandb"']).log.trackers == ["wandb"]
    assert resolve(TrainConfig).log.trackers == []
    with pytest.raises(DipacoError, match=r"names 'tensorbord'; choose among tensorboard, wandb"):
        resolve(TrainConfig, flags={"log.to": "tensorbord"})


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_one_line_naming_its_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what import sees where the package is not installed
    with pytest.raises(DipacoError) as err:
        require(["tensorboard", "wandb"])
    assert str(err.value) == f"--log-to {name} needs the {name} package: pip install -e '.[{name}]'"


# ------------------------------------------------------------------------------------------------ real runs
def test_serve_log_to_needs_a_run(tmp_path, capsys):
    from conftest import one_error_line
    from dipaco.cli.commands import main

    assert main(["serve", "--model", str(tmp_path), "--log-to", "tensorboard"]) == 2
    assert "--log-to needs --run" in one_error_line(capsys, "serve")


def test_eval_and_serve_log_to_the_run_s_tracker_run(small_runs, shards_2x2, tmp_path, monkeypatch):
    from dipaco.cli.commands import main
    from serve_helpers import ServerProcess

    run = tmp_path / "run"
    shutil.copytree(small_runs / "dipaco", run)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["eval", "--run", f"dipaco={run}", "--shards", str(shards_2x2), "--out", str(tmp_path / "r.json"),
                 "--no-oracle", "--no-random", "--quiet", "--log-to", "tensorboard,wandb"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    scalars = tensorboard_scalars(run / "tensorboard")
    assert scalars["eval_ppl/dipaco"] == [(1, pytest.approx(report["methods"]["dipaco"]["perplexity"], rel=1e-6))]
    for _ in range(2):  # two servers: the second one's seconds follow the first one's
        server = ServerProcess("--run", str(run), "--log-to", "tensorboard,wandb", "--set", "log_interval=1",
                               env={"WANDB_MODE": "offline"})
        status, body, _ = server.post("/v1/completions", {"model": "run", "prompt": "def f(x):", "max_tokens": 8})
        assert status == 200, body
        time.sleep(1.2)
        assert server.stop() == 0
    served = tensorboard_scalars(run / "tensorboard")["serve/generated_tokens"]
    steps = [s for s, _ in served]
    assert steps == sorted(set(steps)) and max(v for _, v in served) >= 8  # never a step twice; the tokens counted
    runs = wandb_runs(run)
    assert len({r["id"] for r in runs}) == 1 and len(runs) == 3  # eval and two servers, one W&B run
    assert runs[0]["history"][0]["eval_ppl/dipaco"] == pytest.approx(report["methods"]["dipaco"]["perplexity"])


def expected_tags(grid_paths: list[str], modules: list[str]) -> set[str]:
    return ({f"train_loss/{p}" for p in grid_paths} | {f"val_ppl/{p}" for p in grid_paths}
            | {f"{n}/{m}" for n in NORMS for m in modules} | {"speed/tokens_per_s", "comm/bytes_sent", "comm/wait_s"})


def assert_every_round_once(scalars: dict, tags: set[str], rounds: int) -> None:
    missing = tags - set(scalars)
    assert not missing, f"tags never written: {sorted(missing)}"
    for tag in tags:
        assert [s for s, _ in scalars[tag]] == list(range(1, rounds + 1)), tag  # strictly increasing, none missing


def run_modules(run_dir) -> list[str]:
    from dipaco.storage.run import Run

    return Run(run_dir).grid.modules


@pytest.mark.slow
def test_an_in_process_run_and_its_resume_continue_one_tensorboard_run_and_one_wandb_run(shards_2x2, tmp_path, monkeypatch):
    from conftest import tiny_train_config
    from dipaco.storage import checkpoint
    from dipaco.training.train import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    logged = ['log.to="tensorboard,wandb"', "checkpoint_every=2"]
    train(tiny_train_config(*logged, rounds=3, inner_steps=4), shards_2x2, run, progress=False)
    # a stop after round 3 was logged but before its checkpoint: the resumed run trains round 3 again
    shutil.rmtree(run / "checkpoints" / "round_3")
    (run / "checkpoints" / "latest").write_text("round_2")
    assert checkpoint.latest_round(run) == 2
    train(tiny_train_config(*logged, rounds=5, inner_steps=4), shards_2x2, run, resume=True, progress=False)

    tags = expected_tags(PATHS, run_modules(run))
    scalars = tensorboard_scalars(run / "tensorboard")
    assert_every_round_once(scalars, tags, 5)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in lines if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 3, 4, 5]  # metrics.jsonl has round 3 twice, the trackers once
    assert scalars["train_loss/0-1"][1][1] == pytest.approx(rounds[1]["train_loss_by_trainee"][1])  # the same records
    assert scalars["outer_grad_norm/L1.E0"][4][1] == pytest.approx(rounds[5]["module_norms"]["L1.E0"]["outer_grad_norm"])

    runs = wandb_runs(run)
    kept_id = json.loads((run / "trackers.json").read_text())["wandb"]["wandb_id"]
    assert len(runs) == 2 and {r["id"] for r in runs} == {kept_id}  # two processes, one W&B run
    steps = [row["_step"] for r in runs for row in r["history"]]
    assert steps == [1, 2, 3, 4, 5]
    for r in runs:
        for row in r["history"]:
            assert tags <= set(row), sorted(tags - set(row))
            assert row["val_ppl/1-0"] == pytest.approx(dict(scalars["val_ppl/1-0"])[row["_step"]], rel=1e-6)


@pytest.mark.slow
def test_torchrun_workers_with_streaming_fragments_give_rank_0_s_trackers_every_module_s_norms(shards_2x2, tmp_path):
    from conftest import TINY_TRAIN
    from dipaco.cli.commands import main

    run = tmp_path / "run"
    sets = [*TINY_TRAIN, "streaming.fragments=2", "streaming.overlap=1", "streaming.alpha=0.5"]
    args = ["train", "--shards", str(shards_2x2), "--out", str(run), "--quiet", "--rounds", "3", "--inner-steps", "4",
            "--workers", "2", "--log-to", "tensorboard", *(a for kv in sets for a in ("--set", kv))]
    assert main(args) == 0
    assert len(list((run / "tensorboard").iterdir())) == 1  # rank 0 alone writes
    scalars = tensorboard_scalars(run / "tensorboard")
    modules = run_modules(run)
    norms = {f"{n}/{m}" for n in NORMS for m in modules}
    assert_every_round_once(scalars, expected_tags(PATHS, modules) - norms | {"comm/bytes_received"}, 3)
    # each module's norms come from the rank that owns it; a fragment's outer step lands τ steps after its sync, so the
    # one fragment synced at a round's last step steps in the next round: from round 2 on, every module has stepped
    missing = norms - set(scalars)
    assert not missing, sorted(missing)
    for tag in norms:
        steps = [s for s, _ in scalars[tag]]
        assert steps in ([1, 2, 3], [2, 3]), (tag, steps)  # once a round, none repeated
    assert all(v > 0 for _, v in scalars["comm/bytes_sent"]) and {v for _, v in scalars["workers/present"]} == {2.0}
