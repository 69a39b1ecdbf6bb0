"""Sticky trainees: storage bytes per phase with and without them, on a 2x2 run over two Ray nodes.

    python bench/sticky_storage.py [--rounds 8] [--H 10] [--bits 32 4] [--checkpoint-every 1 4]

Trains the same DiPaCo 2x2 run (the `tiny` preset, one thread per trainee, the same seed) with
``dipaco train --engine ray`` on a local two-node Ray cluster (two one-CPU nodes, as Ray sees two machines), once
with ``ray.sticky=false`` (every phase reads its trainee's AdamW state from storage) and once with the default
``ray.sticky=true`` (a phase prefers the node that trained its trainee last and reads the state from that node's
cache; storage keeps the durable copy at every checkpoint round), at each ``--checkpoint-every``: with K > 1 a
trainee's state goes to storage only every K rounds. No node is lost. Storage bytes per phase come from
metrics.jsonl (each phase's ``storage_read`` + ``storage_written``, as its storage interface counted them), over
rounds 2..R (round 1 has nothing cached yet); the outer steps' bytes are given apart. Checks that every run ends
bit-identical to the plain one. Prints a table; writes ``bench/sticky_storage_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_engine import same_weights  # noqa: E402
from worker_speed import make_shards  # noqa: E402

HERE = Path(__file__).resolve().parent


def train(shards: Path, out: Path, address: str, rounds: int, H: int, bits: int, sticky: bool, every: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DIPACO_RAY_AUTH_WARNED": "1"}
    cmd = [sys.executable, "-m", "dipaco.cli", "train", "--shards", str(shards), "--out", str(out), "--preset", "tiny",
           "--rounds", str(rounds), "--inner-steps", str(H), "--bits", str(bits), "--quiet", "--engine", "ray",
           "--address", address, "--set", f"ray.sticky={'true' if sticky else 'false'}", "--set", f"checkpoint_every={every}"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "round"]


def per_phase(rounds: list[dict]) -> dict:
    phases = [p for r in rounds[1:] for p in r["phases"]]
    read = sum(p["storage_read"] for p in phases) / len(phases)
    written = sum(p["storage_written"] for p in phases) / len(phases)
    steps = sum(r["storage_read"] + r["storage_written"] for r in rounds[1:]) - (read + written) * len(phases)
    return {"phases": len(phases), "read": read, "written": written, "total": read + written,
            "cached": sum(bool(p.get("state_cached")) for p in phases), "replayed": sum(p.get("replayed", 0) for p in phases),
            "outer_steps_per_round": steps / len(rounds[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--bits", type=int, nargs="+", default=[32, 4])
    ap.add_argument("--checkpoint-every", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shards, _ = make_shards(Path(tmp))
            for bits in args.bits:
                plain = Path(tmp) / f"b{bits}-plain"
                began = time.perf_counter()
                base = per_phase(train(shards, plain, cluster.address, args.rounds, args.H, bits, False, 1))
                base["wall_s"] = time.perf_counter() - began
                for every in args.checkpoint_every:
                    out = Path(tmp) / f"b{bits}-sticky-{every}"
                    began = time.perf_counter()
                    run = per_phase(train(shards, out, cluster.address, args.rounds, args.H, bits, True, every))
                    run["wall_s"] = time.perf_counter() - began
                    results.append({"bits": bits, "checkpoint_every": every, "plain": base, "sticky": run,
                                    "saved": 1 - run["total"] / base["total"], "bit_identical": same_weights(plain, out)})
    finally:
        cluster.shutdown()
    print("| bits | checkpoint_every | storage bytes / phase, plain | sticky | saved | state from the node cache |"
          " bit-identical |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        print(f"| {r['bits']} | {r['checkpoint_every']} | {r['plain']['total']:,.0f} | {r['sticky']['total']:,.0f} | {r['saved']:.1%} | "
              f"{r['sticky']['cached']}/{r['sticky']['phases']} | {'yes' if r['bit_identical'] else 'NO'} |")
    (HERE / "sticky_storage_results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
