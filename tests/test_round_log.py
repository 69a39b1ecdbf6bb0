"""The one round log (dipaco.training.round_log): what every engine writes to metrics.jsonl and hands to the trackers
(fast tier)."""

from __future__ import annotations

import json

from dipaco.training.round_log import RoundLog


def _inner(step: int, trainee: int) -> dict:
    return {"kind": "inner", "round": 1, "step": step, "trainee": trainee, "path": "0-0", "loss": 1.0 + step, "lr": 0.1}


def test_a_round_writes_its_inner_lines_in_step_order_then_its_line_and_the_listeners_see_the_same(tmp_path):
    seen = []
    log = RoundLog(tmp_path, total_steps=8, progress=False, listeners=[seen.append])
    # a Ray driver's phases come trainee by trainee; the lines go by step, then trainee
    line = log.round(1, [2.0, None, 4.0], {"0-0": 3.0}, seconds=2.0, tokens=100, workers=2, bytes_sent=10,
                     bytes_received=20, inner=[_inner(2, 1), _inner(1, 1), _inner(2, 0), _inner(1, 0)], engine="ray",
                     dropped=[1])
    log.close()
    written = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == seen
    assert [(r["step"], r["trainee"]) for r in written[:4]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert written[4] == line and line["kind"] == "round" and line["engine"] == "ray" and line["dropped"] == [1]
    assert line["train_loss"] == 3.0 and line["train_loss_by_trainee"] == [2.0, None, 4.0]  # a dropped phase: None
    assert line["tokens_per_s"] == 50.0 and line["val_loss_mean"] == 3.0


def test_a_process_that_does_not_write_leaves_no_file_and_tells_no_listener(tmp_path):
    seen = []
    log = RoundLog(tmp_path, total_steps=8, progress=False, writes=False, listeners=[seen.append])
    line = log.round(1, [1.0], {}, seconds=1.0, tokens=10, workers=2, bytes_sent=0, bytes_received=0,
                     inner=[_inner(1, 0)])
    log.close()
    assert line["train_loss"] == 1.0 and not (tmp_path / "metrics.jsonl").exists() and seen == []
