"""shard -> train -> eval for real on small data, through the CLI entry point."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from dipaco.cli.commands import main
from dipaco.eval.perplexity import evaluate
from dipaco.storage import checkpoint
from dipaco.storage.run import Run
from dipaco.training.train import train

from conftest import TINY_TRAIN, tiny_train_config


def _cli_train_args(shards, out, *extra):
    sets = [a for kv in TINY_TRAIN for a in ("--set", kv)]
    return ["train", "--shards", str(shards), "--out", str(out), "--quiet", *sets, *extra]


@pytest.mark.slow
def test_shard_train_eval_beats_untrained(shards_2x2, tmp_path):
    run = tmp_path / "dipaco"
    assert main(_cli_train_args(shards_2x2, run, "--rounds", "3", "--inner-steps", "20")) == 0
    dense = tmp_path / "dense"
    assert main(_cli_train_args(shards_2x2, dense, "--rounds", "3", "--inner-steps", "20", "--grid", "1")) == 0
    r = Run(run)
    assert r.rounds == [0, 1, 2, 3] and r.grid.num_paths == 4
    stored = sorted(p.stem for p in (run / "checkpoints" / "round_3" / "modules").glob("*.safetensors"))
    assert stored == sorted(["embed", "head", "L0.E0", "L0.E1", "L1.E0", "L1.E1"])  # shared modules stored once
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["round"] for l in lines if l["kind"] == "round"] == [1, 2, 3]

    report_file = tmp_path / "report.json"
    assert main(["eval", "--run", f"dipaco={run}", "--run", f"dense={dense}", "--shards", str(shards_2x2),
                 "--out", str(report_file), "--quiet"]) == 0
    report = json.loads(report_file.read_text())
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.png").stat().st_size > 0
    trained = report["methods"]["dipaco"]
    assert math.isfinite(trained["perplexity"]) and trained["tokens"] > 0
    assert report["methods"]["dense"]["tokens"] == trained["tokens"]  # same tokens for every method
    untrained = evaluate({"round0": run}, shards_2x2, round=0, progress=False)["methods"]["round0"]
    assert untrained["tokens"] == trained["tokens"]
    assert trained["perplexity"] < 0.5 * untrained["perplexity"], (trained["perplexity"], untrained["perplexity"])


def test_prefix_is_not_scored():
    from dipaco.model.path_model import llama_config, new_model
    from dipaco.model.scoring import document_nll

    model = new_model(llama_config(tiny_train_config().model, 512, 0), seed=0)
    docs = [list(range(1, 101)), list(range(1, 33)), list(range(1, 34))]
    scores = document_nll(model, docs, context=32, seq_len=16, batch_size=3)
    assert [n for _, n in scores] == [100 - 32, 0, 1]
    # the same document scored in one window or many gives the same total
    whole = document_nll(model, docs[:1], context=32, seq_len=128, batch_size=2)
    assert whole[0][1] == 68


@pytest.mark.slow
def test_resume_is_bit_identical(shards_2x2, tmp_path):
    """A 2-round run stopped after round 1 and resumed ends as the straight run, bit for bit. (Extending a
    finished 1-round run to 2 rounds is not the same run: its lr schedule stays the 1-round one, see
    tests/test_schedule.py.)"""
    cfg = tiny_train_config(rounds=2, inner_steps=6)
    train(cfg, shards_2x2, tmp_path / "straight", progress=False)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "round_2")  # stopped after round 1
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("round_1\n")
    train(cfg, shards_2x2, tmp_path / "resumed", resume=True, progress=False)
    a = checkpoint.load_modules(tmp_path / "straight", 2)
    b = checkpoint.load_modules(tmp_path / "resumed", 2)
    assert a.keys() == b.keys()
    for m in a:
        for n in a[m]:
            assert torch.equal(a[m][n], b[m][n]), (m, n)


@pytest.mark.slow
def test_console_script_errors_exit_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dipaco.cli", "train", "--shards", str(tmp_path / "nope"),
                           "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr
    assert not (tmp_path / "run").exists()
