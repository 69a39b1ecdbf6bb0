"""--log-to on the Ray engine: the driver's trackers get every round once, with a worker SIGKILLed mid-phase (slow
tier; the kill as tests/test_ray_storage.py does it, on the session's local two-node cluster)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from faults import fault_env
from test_ray_storage import attempts, bucket, command, finish, local_copy, start, wait_for  # noqa: F401 (bucket)
from test_trackers import PATHS, assert_every_round_once, expected_tags
from tracker_readers import tensorboard_scalars

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.slow


def test_a_ray_run_with_a_worker_killed_gives_tensorboard_every_round_once(shards_2x2, ray_cluster, tmp_path):
    from dipaco.storage.objects import Storage
    from dipaco.storage.run import Run

    out = tmp_path / "run"
    proc = start(command(shards_2x2, out, "--log-to", "tensorboard", address=ray_cluster.address),
                 env=fault_env("1:1:60", tmp_path / "faults"))
    victim = wait_for(lambda: (a := attempts(Storage(str(out)), 1, "trainee_1")) and a[0], "phase (1, 1) to start",
                      timeout=600)  # a whole first round before it, on a busy machine
    time.sleep(1.0)  # asleep halfway through its inner steps now
    os.kill(victim["pid"], signal.SIGKILL)
    finish(proc, timeout=600)

    scalars = tensorboard_scalars(out / "tensorboard")
    tags = expected_tags(PATHS, Run(out).grid.modules) - {"comm/wait_s"}  # no reductions to wait on: storage
    assert_every_round_once(scalars, tags | {"phases/retried", "phases/dropped", "workers/present"}, 2)
    assert dict(scalars["phases/retried"]) == {1: 0.0, 2: 1.0}  # the killed phase (trainee 1, round 2), retried once
    assert dict(scalars["phases/dropped"]) == {1: 0.0, 2: 0.0}


def test_a_bucket_run_extended_by_a_new_driver_continues_its_tensorboard_run(shards_2x2, ray_cluster, bucket):
    url = f"{bucket}/run"
    finish(start(command(shards_2x2, url, "--log-to", "tensorboard", address=ray_cluster.address, rounds=1)), 600)
    finish(start(command(shards_2x2, url, "--log-to", "tensorboard", address=ray_cluster.address, rounds=2,
                         resume=True)), 600)
    run = local_copy(url)  # the bucket's copy: what the drivers pushed
    scalars = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["train_loss/0-0"]] == [1, 2]  # the second driver appended round 2 only
    assert json.loads((run / "trackers.json").read_text())["tensorboard"]["round"] == 2
