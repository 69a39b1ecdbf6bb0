"""--log-to on the Ray engine (slow tier): a run in a bucket with a worker SIGKILLed mid-phase (the kill as
tests/test_ray_storage.py does it, on the session's local two-node cluster), then extended by a new driver: the
bucket's TensorBoard run has every round once."""

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


def test_a_bucket_run_with_a_worker_killed_then_a_new_driver_gives_tensorboard_every_round_once(
        shards_2x2, ray_cluster, bucket, tmp_path):
    from dipaco.storage.objects import Storage
    from dipaco.storage.run import Run

    url = f"{bucket}/run"
    proc = start(command(shards_2x2, url, "--log-to", "tensorboard", address=ray_cluster.address),
                 env=fault_env("1:1:60", tmp_path / "faults"))
    victim = wait_for(lambda: (a := attempts(Storage(url), 1, "trainee_1")) and a[0], "phase (1, 1) to start",
                      timeout=600)  # a whole first round before it, on a busy machine
    time.sleep(1.0)  # asleep halfway through its inner steps now
    os.kill(victim["pid"], signal.SIGKILL)
    finish(proc, timeout=600)
    # a new driver extends the run by a round: it pulls the tracker files, appends, pushes them back
    finish(start(command(shards_2x2, url, "--log-to", "tensorboard", address=ray_cluster.address, rounds=3,
                         resume=True)), 600)

    run = local_copy(url)  # the bucket's copy: what the drivers pushed
    scalars = tensorboard_scalars(run / "tensorboard")
    tags = expected_tags(PATHS, Run(run).grid.modules) - {"comm/wait_s"}  # no reductions to wait on: storage
    assert_every_round_once(scalars, tags | {"phases/retried", "phases/dropped", "workers/present"}, 3)
    assert dict(scalars["phases/retried"]) == {1: 0.0, 2: 1.0, 3: 0.0}  # the killed phase, retried once
    assert dict(scalars["phases/dropped"]) == {1: 0.0, 2: 0.0, 3: 0.0}
    assert json.loads((run / "trackers.json").read_text())["tensorboard"]["round"] == 3
