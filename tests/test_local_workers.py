"""The local engine's worker processes (dipaco.training.local_workers): a round's phases side by side in spawned
processes give the bits of one process: modules, outer momentum and every trainee's AdamW state, at every round."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_TRAIN, tiny_train_config
from dipaco.cli.commands import main
from dipaco.storage import checkpoint
from dipaco.training.local_workers import default_workers
from dipaco.training.train import train

ROUNDS, H = 2, 4


def _tensors(obj, prefix=""):
    """Every tensor in a nested state, by its path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, list):
        for k, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{k}")


def _assert_same_bits(a, b):
    for r in range(1, ROUNDS + 1):
        ma, mb = checkpoint.load_modules(a, r), checkpoint.load_modules(b, r)
        assert ma.keys() == mb.keys()
        assert all(torch.equal(ma[m][n], mb[m][n]) for m in ma for n in ma[m]), r
        (outer_a, states_a, _), (outer_b, states_b, _) = checkpoint.load_state(a, r), checkpoint.load_state(b, r)
        assert outer_a.keys() == outer_b.keys() and all(torch.equal(outer_a[k], outer_b[k]) for k in outer_a)
        ta, tb = dict(_tensors(states_a)), dict(_tensors(states_b))
        assert ta.keys() == tb.keys() and len(ta) > 0
        assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])][:3]
        assert [s["step"] for s in states_a] == [s["step"] for s in states_b] == [r * H] * len(states_a)


def _losses(run):
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [(l["kind"], l.get("loss"), l.get("train_loss_by_trainee"), l.get("val_loss")) for l in lines]


@pytest.mark.slow
def test_worker_processes_and_the_cli_default_give_the_bits_of_one_process(shards_2x2, tmp_path):
    cfg = tiny_train_config(rounds=ROUNDS, inner_steps=H)
    one, two, cli = tmp_path / "one", tmp_path / "two", tmp_path / "cli"
    train(cfg, shards_2x2, one, progress=False, workers=1)
    args = ["train", "--shards", str(shards_2x2), "--quiet", "--rounds", str(ROUNDS), "--inner-steps", str(H)]
    for kv in TINY_TRAIN:
        args += ["--set", kv]
    assert main(args + ["--out", str(two), "--num-proc", "2"]) == 0  # 4 trainees on 2 processes, whatever the cores
    assert main(args + ["--out", str(cli)]) == 0  # the CLI default: one worker process per core, at most one per trainee
    for other in (two, cli):
        _assert_same_bits(one, other)
        assert _losses(one) == _losses(other)
    assert default_workers(4) == min(4, default_workers(1000)) and default_workers(1) == 1
