"""A driver that waits out its cluster, never spins and leaves nothing behind (slow tier; issue #38).

Real parts: the session's local two-node Ray cluster, a head started by `ray start --head --block` that the test
stops and restarts, the moto S3 server (tests/s3server.py), the real CLI in its own process. Runs are 2x2, 3 rounds
of 6 inner steps, compared bit for bit with the in-process engine's run of the same config.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import tiny_train_config
from test_ray_storage import H, assert_same_state, command, start, wait_for

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow

ROUNDS = 3


_references: dict[int, Path] = {}


def reference(shards: Path, tmp_path_factory, rounds: int = ROUNDS) -> Path:
    """The in-process engine's run of the same config (one per number of rounds, per session)."""
    from dipaco.training.train import train

    if rounds not in _references:
        out = tmp_path_factory.mktemp("reference") / "run"
        train(tiny_train_config(rounds=rounds, inner_steps=H), shards, out, progress=False)
        _references[rounds] = out
    return _references[rounds]


def finish(proc, timeout: float = 300) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s: {err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out, err


def test_a_resume_whose_round_lacks_a_committed_phases_validation_finishes(shards_2x2, ray_cluster, tmp_path,
                                                                           tmp_path_factory):
    """The stuck state of issue #38: a driver SIGKILLed while the outer steps to round 4 run, with round 2 the last
    checkpoint, round 3 logged and every phase of round 4 committed; one of round 3's validations then gone from
    storage. The resumed driver found nothing in flight and nothing to launch, and looped without end without
    sleeping; now it validates that path again and finishes."""
    out, sets = tmp_path / "run", ("--set", "checkpoint_every=2", "--set", "ray.sticky=false")
    proc = start(command(shards_2x2, out, *sets, address=ray_cluster.address, rounds=4),
                 env={"DIPACO_TEST_DELAY": "step:3:60"})
    wait_for(lambda: len(list(out.glob("queue/*/phases/3/trainee_*/commit.json"))) == 4
             and list(out.glob("queue/*/attempts/3/step_*/*.json")), "round 4's phases and an outer step", timeout=240)
    proc.kill()
    proc.communicate()
    vals = sorted(out.glob("queue/*/val/3/*.json"))
    assert len(vals) == 4 and (out / "checkpoints" / "latest").read_text().strip() == "round_2"
    vals[2].unlink()
    before = len((out / "metrics.jsonl").read_text().splitlines())
    printed, _ = finish(start(command(shards_2x2, out, *sets, address=ray_cluster.address, rounds=4, resume=True)),
                        timeout=180)
    assert_same_state(reference(shards_2x2, tmp_path_factory, rounds=4), out, rounds=4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if r["kind"] == "round"] == [1, 2, 3, 4]
    mine = [r for r in rows[before:] if r["kind"] == "round"]
    summary = json.loads(printed.strip().splitlines()[-1])  # the summary line: the sum of this command's rounds
    assert [r["round"] for r in mine] == [4]
    for key in ("storage_read", "storage_written"):
        assert summary[key] == mine[0][key] > 0, key
