"""Soak: one DiPaCo 2x2 run into a bucket under `--keep-going`, through random faults, compared bit for bit.

    python bench/soak.py                      # 20 faults on a 6-round run (JSON: bench/soak_results.json)
    python bench/soak.py --faults 4 --quick   # shorter outages, for a smoke run

Real parts only: the moto S3 server (tests/s3server.py) holds the run, a Ray head started by
`RAY_AUTH_MODE=token ray start --head --block` runs it, and `dipaco train --keep-going` drives it. While the run
goes, faults are drawn at random, one at a time, each once the run has recovered from the last:

  driver    SIGKILL of the driver (the supervisor starts a new one, which resumes from the bucket)
  worker    SIGKILL of a Ray worker running a phase (Ray retries it)
  head      the head stopped (SIGTERM, as a service manager does) and started again on the same port 5-15 s later
  storage   the S3 server paused (SIGSTOP) for 30-90 s (10-20 s with --quick), then resumed (SIGCONT)

A fault's recovery time is from its end (the kill, the restart, the resume) to the next commit record or
checkpoint that appears in the bucket. At the end: the bucket run's last checkpoint (modules, outer momentum,
every trainee's state) against the in-process engine's run of the same config, and what is left behind: the
driver's temporary mirrors and any process of the head's Ray sessions or of dipaco.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from s3server import start_s3_server  # noqa: E402
from worker_speed import make_shards  # noqa: E402

SETS = ["inner.batch_size=4", "val_batches=1", "log_every=10"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Head:
    """`RAY_AUTH_MODE=token ray start --head --block` on a fixed port; its session names, for the leftover check."""

    def __init__(self, port: int, log: Path):
        self.port, self.log, self.proc, self.sessions = port, log, None, []
        self.address = f"127.0.0.1:{port}"

    def start(self) -> None:
        from dipaco.taskqueue.ray_cluster import reachable

        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--port",
                                          str(self.port), "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
                                          "--include-dashboard", "false", "--disable-usage-stats", "--block"],
                                         env={**os.environ, "RAY_AUTH_MODE": "token"}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        until = time.time() + 90
        while reachable(self.address) is not None or not list(Path("/tmp/ray").glob(f"session_*_{self.proc.pid}")):
            if time.time() > until:
                raise RuntimeError(f"the head did not start; see {self.log}")
            time.sleep(0.5)
        self.sessions.append(next(Path("/tmp/ray").glob(f"session_*_{self.proc.pid}")).name)
        time.sleep(2)  # its raylet registers after the GCS answers

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=90)


class Progress:
    """Commit records and checkpoints seen in the bucket (a set that only grows) and when each first appeared."""

    def __init__(self, server, bucket: str, prefix: str):
        import boto3
        from botocore.config import Config

        self.s3 = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                               aws_secret_access_key="testing", region_name="us-east-1",
                               config=Config(connect_timeout=2, read_timeout=2, retries={"max_attempts": 1}))
        self.bucket, self.prefix, self.seen, self.events = bucket, prefix, set(), []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(0.5):
            try:
                pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
                keys = {o["Key"] for page in pages for o in page.get("Contents", [])
                        if o["Key"].endswith(("commit.json", "state/meta.json"))}
            except Exception:  # the server is paused: nothing to see
                continue
            now = time.time()
            for k in sorted(keys - self.seen):
                self.events.append(now)
            self.seen |= keys

    def after(self, t: float, timeout: float) -> float | None:
        """Seconds from t to the first new commit after t (None when none came within timeout, or the run ended)."""
        until = time.time() + timeout
        while time.time() < until:
            later = [e for e in self.events if e > t]
            if later:
                return min(later) - t
            time.sleep(0.2)
        return None


def children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except (OSError, ValueError, IndexError):
            continue
    return out


def phase_workers() -> list[int]:
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::_phase"):
                found.append(int(p))
        except OSError:
            continue
    return found


def holders(names: list[str]) -> list[str]:
    """Processes whose command line or open files name one of ``names`` (Ray sessions, the run's URL)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        if int(p) == os.getpid():
            continue
        try:
            line = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            files = [os.readlink(f) for f in Path(f"/proc/{p}/fd").iterdir()]
        except OSError:
            continue
        if any(n in line or any(n in f for f in files) for n in names):
            found.append(f"{p} {line[:80]}")
    return found


def same_state(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def equal(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
        if type(x).__module__ == "numpy":
            return bool((x == y).all())
        return x == y

    last = (a / "checkpoints" / "latest").read_text().strip()
    if last != (b / "checkpoints" / "latest").read_text().strip():
        return False
    ra, rb = a / "checkpoints" / last, b / "checkpoints" / last
    names = sorted(str(p.relative_to(ra)) for p in ra.rglob("*.safetensors"))
    for n in names:
        if not equal(load_file(str(ra / n)), load_file(str(rb / n))):
            return False
    states = sorted(p.name for p in (ra / "state").glob("trainee_*.pt"))
    return bool(names and states) and all(
        equal(torch.load(ra / "state" / s, weights_only=True), torch.load(rb / "state" / s, weights_only=True))
        for s in states)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=150, help="long enough for the faults to land mid-run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="storage paused 10-20 s instead of 30-90 s")
    p.add_argument("--work", default=str(ROOT.parent / "bench-work" / "soak"))
    p.add_argument("--json", default=str(ROOT / "bench" / "soak_results.json"))
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shards, source = make_shards(work)
    sets = [a for kv in SETS for a in ("--set", kv)]
    base = ["--shards", str(shards), "--preset", "tiny", "--rounds", str(args.rounds), "--inner-steps",
            str(args.inner_steps), "--quiet", *sets]

    reference = work / f"reference-r{args.rounds}-h{args.inner_steps}"
    if not (reference / "checkpoints" / f"round_{args.rounds}").is_dir():
        subprocess.run([sys.executable, "-m", "dipaco.cli", "train", "--out", str(reference), *base,
                        *(["--resume"] if reference.exists() else [])], check=True, stdout=subprocess.DEVNULL)

    server = start_s3_server()
    bucket = server.make_bucket("soak")
    url = f"s3://{bucket}/run"
    tmp = Path(tempfile.mkdtemp(prefix="soak-tmp-"))  # the drivers' TMPDIR: their mirrors go here
    head = Head(free_port(), work / "head.log")
    head.start()
    env = {**os.environ, **server.env, "RAY_AUTH_MODE": "token", "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    log = open(work / "driver.log", "w")
    began = time.time()
    supervisor = subprocess.Popen([sys.executable, "-m", "dipaco.cli", "train", "--out", url, "--engine", "ray",
                                   "--address", head.address, "--keep-going", *base], env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    progress = Progress(server, bucket, "run/")
    faults: list[dict] = []
    try:
        while len(faults) < args.faults and supervisor.poll() is None:
            time.sleep(rng.uniform(2, 6))
            if supervisor.poll() is not None:
                break
            kind = rng.choice(["driver", "worker", "head", "storage"])
            fault = {"kind": kind, "at_s": round(time.time() - began, 1)}
            if kind == "driver":
                drivers = children(supervisor.pid)
                if not drivers:
                    continue
                os.kill(drivers[0], signal.SIGKILL)
            elif kind == "worker":
                workers = phase_workers()
                if not workers:
                    continue
                os.kill(rng.choice(workers), signal.SIGKILL)
            elif kind == "head":
                head.stop()
                fault["down_s"] = round(rng.uniform(5, 15), 1)
                time.sleep(fault["down_s"])
                head.start()
            else:
                fault["paused_s"] = round(rng.uniform(10, 20) if args.quick else rng.uniform(30, 90), 1)
                os.kill(server.process.pid, signal.SIGSTOP)
                time.sleep(fault["paused_s"])
                os.kill(server.process.pid, signal.SIGCONT)
            ended = time.time()
            fault["recovery_s"] = progress.after(ended, timeout=900)
            if fault["recovery_s"] is not None:
                fault["recovery_s"] = round(fault["recovery_s"], 1)
            faults.append(fault)
            print(f"fault {len(faults):2d} at {fault['at_s']:7.1f} s: {kind:8s}"
                  f"{' down %.1f s' % fault['down_s'] if 'down_s' in fault else ''}"
                  f"{' paused %.1f s' % fault['paused_s'] if 'paused_s' in fault else ''}"
                  f"  recovered in {fault['recovery_s']} s", flush=True)
        rc = supervisor.wait(timeout=3600)
    finally:
        progress.stop.set()
        if supervisor.poll() is None:
            supervisor.kill()
        log.close()
    wall = time.time() - began
    from dipaco.taskqueue.runstore import pull_run

    os.environ.update(server.env)
    shutil.rmtree(work / "pulled", ignore_errors=True)  # a copy of an earlier soak's run would be taken as this one's
    run = pull_run(url, into=work / "pulled")
    identical = rc == 0 and same_state(reference, run)
    head.stop()
    time.sleep(3)
    left = {"mirrors": sorted(p.name for p in tmp.glob("dipaco-run-*")), "processes": holders(head.sessions + [bucket])}
    server.stop()
    result = {"rounds": args.rounds, "inner_steps": args.inner_steps, "seed": args.seed, "quick": args.quick,
              "shards": source, "exit_code": rc, "wall_s": round(wall, 1), "bit_identical": identical,
              "faults": faults, "left_behind": left,
              "recovery_s_by_kind": {k: [f["recovery_s"] for f in faults if f["kind"] == k]
                                     for k in ("driver", "worker", "head", "storage")}}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n| # | fault | at s | outage s | recovered in s |\n| ---: | --- | ---: | ---: | ---: |")
    for i, f in enumerate(faults, 1):
        print(f"| {i} | {f['kind']} | {f['at_s']} | {f.get('down_s', f.get('paused_s', '-'))} | {f['recovery_s']} |")
    print(f"\nexit code {rc}, {wall:.0f} s, bit-identical to the in-process run: {identical}; left behind: {left}")
    return 0 if identical and not left["mirrors"] and not left["processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
