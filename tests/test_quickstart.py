"""The README's main command, shrunk: default corpus -> 2x2 shards -> DiPaCo and dense -> report."""

import json

import pytest

from dipaco.cli.quickstart import quickstart

from conftest import TINY_TRAIN

pytestmark = pytest.mark.slow  # the whole pipeline


def test_quickstart_small(tmp_path, capsys):
    out = tmp_path / "qs"
    report = quickstart(out, rounds=1, inner_steps=3, overrides=TINY_TRAIN, progress=False, budget_per_kind=150_000)
    assert set(report["methods"]) == {"dipaco-2x2", "dense"}
    assert all(m["perplexity"] > 1 for m in report["methods"].values())
    assert json.loads((out / "report.json").read_text())["methods"].keys() == report["methods"].keys()
    printed = capsys.readouterr().out
    assert "| dipaco-2x2 |" in printed and "| dense |" in printed and str(out) in printed
    # running it again reuses everything that is complete
    again = quickstart(out, rounds=1, inner_steps=3, overrides=TINY_TRAIN, progress=False, budget_per_kind=150_000)
    assert again["methods"]["dense"]["perplexity"] == report["methods"]["dense"]["perplexity"]
    assert "already trained" in capsys.readouterr().out
