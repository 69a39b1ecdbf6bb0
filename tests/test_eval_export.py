"""Export a path as a plain Hugging Face directory and load it back without dipaco."""

import json

import pytest
import torch

from dipaco.cli.commands import main
from dipaco.errors import DipacoError
from dipaco.eval.api import load

from eval_helpers import private_run

pytestmark = pytest.mark.slow  # a trained run (real shards)


@pytest.fixture(scope="module")
def rr(tmp_path_factory, shards_2x2):
    return load(private_run(tmp_path_factory, shards_2x2))


def test_export_round_trip_same_logits(rr, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main(["export", "--run", str(rr.run.root), "--path", "1-0", "--out", str(out), "--round", "1", "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == "llama"  # nothing points back at dipaco
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    text = "Permission is hereby granted, free of charge, to any person"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == rr.encode(text)
    with torch.no_grad():
        ours = rr.path_model("1-0", 1).model(input_ids=ids).logits
        theirs = model(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    meta = json.loads((out / "dipaco_export.json").read_text())
    assert meta["path"] == "1-0" and meta["round"] == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary directory left behind


def test_export_bad_inputs(rr, tmp_path):
    with pytest.raises(DipacoError, match="not in run"):
        rr.export("5-5", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(DipacoError, match="already exists"):
        rr.export("0-0", tmp_path / "taken")
    assert main(["export", "--run", str(rr.run.root), "--path", "0-0", "--out", str(tmp_path / "y"), "--round", "42",
                 "--quiet"]) == 2
    assert not (tmp_path / "y").exists()
