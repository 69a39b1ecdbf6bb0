"""``dipaco train --engine ray --address ADDR --keep-going``: a parent process that outlives the cluster.

The Ray driver may die with its cluster (its connection to the head is lost and Ray ends the process), so the driver
runs as a child of this small supervisor, which imports no Ray. The supervisor:

  - waits while nothing answers at the cluster's address, saying so when the outage begins, once a minute while it
    lasts, and when the cluster answers again (not on every retry);
  - starts the driver (``dipaco train`` without ``--keep-going``; with ``--resume`` once storage holds the run);
  - while the driver runs, probes the address every few seconds; when the head has stopped answering for a while the
    driver is stopped (it would hang or die anyway) and the supervisor waits for the cluster again;
  - ends when the driver ends for any other reason: the run is done (0), or an error that is not a loss of machines
    (the driver's own one-line message, passed through, and its exit code 2). A driver that ends otherwise (Ray
    ends a driver whose head went away) is a loss as well, unless it happens CRASHES times in a row, each within
    CRASH_S seconds, while the cluster answers.

The run directory (shared or in a bucket) is the source of truth, so every new driver resumes where storage says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dipaco.taskqueue.ray_cluster import reachable

LOST = 75        # the driver's exit code when it could not reach the cluster (EX_TEMPFAIL)
PROBE_S = 2.0    # seconds between probes of the cluster's address
LOST_AFTER = 3   # probes in a row without an answer before a running driver is stopped
CRASH_S = 60.0   # a driver that ends sooner, for no reason it names, counts towards CRASHES
CRASHES = 5      # ... that many in a row end the supervisor (a fault of the driver, not of the cluster)


def supervise(argv: list[str], address: str, run_exists) -> int:
    """Run ``dipaco <argv>`` (a train command, without --keep-going) until it ends with something other than a loss
    of the cluster; ``run_exists()``: whether storage holds the run yet (the next driver then resumes it)."""
    env = {**os.environ, "DIPACO_SUPERVISED": "1"}
    stop = {"signal": None}
    crashes = 0  # drivers in a row that ended early, neither done nor with an error of the run nor with a lost cluster

    def forward(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, forward)
    while True:
        if not _wait_for(address, stop):
            return _stopped(stop)
        args = list(argv)
        if run_exists() and "--resume" not in args:
            args.append("--resume")
        began = time.time()
        child = subprocess.Popen([sys.executable, "-m", "dipaco.cli", *args], env=env)
        env["DIPACO_RAY_AUTH_WARNED"] = "1"  # the unauthenticated-cluster warning once, not from every driver
        lost = _watch(child, address, stop)
        if stop["signal"] is not None:
            return _stopped(stop)
        rc = child.returncode
        if rc in (0, 2) and not lost:
            return rc  # done, or an error of the run's own (its line is on stderr already)
        if lost or rc == LOST or reachable(address) is not None:
            crashes = 0
            continue
        # Ray ends a driver whose head went away (its native client exits the process), and a head restarted at
        # once answers again before this loop looks: such an end is a loss too, unless it keeps happening at once
        crashes = crashes + 1 if time.time() - began < CRASH_S else 1
        if crashes >= CRASHES:
            print(f"dipaco train: the driver ended {crashes} times in a row within {CRASH_S:.0f} s (exit code {rc}) "
                  f"while the cluster answered; its messages are above: --keep-going stops here", file=sys.stderr,
                  flush=True)
            return rc if rc > 0 else 1


def _wait_for(address: str, stop: dict) -> bool:
    """Block until the address answers (True), or a signal asks to stop (False); one line when the wait begins,
    one when the cluster is back, and one a minute in between."""
    said = began = 0.0
    while (why := reachable(address)) is not None:
        if stop["signal"] is not None:
            return False
        now = time.time()
        if not said or now - said >= 60:
            waited = f" (for {now - began:.0f} s)" if said else ""
            print(f"dipaco train: waiting for the Ray cluster at {address}{waited} ({why}); --keep-going goes on from "
                  f"what storage holds when it answers", file=sys.stderr, flush=True)
            began, said = began or now, now
        time.sleep(PROBE_S)
    if said:
        print(f"dipaco train: the Ray cluster at {address} answers again after {time.time() - began:.0f} s; resuming "
              f"from storage", file=sys.stderr, flush=True)
    return True


def _watch(child: subprocess.Popen, address: str, stop: dict) -> bool:
    """Wait for the driver; True when it was stopped because the cluster stopped answering."""
    misses = 0
    while child.poll() is None:
        if stop["signal"] is not None:
            child.send_signal(signal.SIGTERM)
            child.wait()
            return False
        misses = misses + 1 if reachable(address) else 0
        if misses >= LOST_AFTER:
            child.kill()
            child.wait()
            return True
        try:
            child.wait(PROBE_S)
        except subprocess.TimeoutExpired:
            pass
    return False


def _stopped(stop: dict) -> int:
    print("dipaco train: stopped by a signal; completed rounds are kept in the run directory: continue with "
          "--resume (and --keep-going)", file=sys.stderr)
    return 128 + int(stop["signal"] or signal.SIGTERM)
