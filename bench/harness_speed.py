"""Requests per second of the dipaco harness model (``dipaco.eval.harness.DipacoLM``) against the harness's own hf
model on an exported path, on the same loglikelihood requests (passages of held-out and router documents and their
next tokens), one process, one thread.

    python bench/harness_speed.py --run RUN [--export DIR] [--requests 1000] [--passage 48] [--answer 16]

Rows: the run routed by its once rule, the shard router alone, one request per forward pass, a pinned path; with
--export (``dipaco export`` of a path), the hf model on it and the largest difference from the pinned path's numbers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def requests(rr, passage: int, answer: int, n: int) -> list[tuple[str, str]]:
    out = []
    for d in rr.shards.heldout() + rr.shards.router_docs():
        ids = rr.encode(d["text"])
        out += [(rr.decode(ids[a:a + passage]), rr.decode(ids[a + passage:a + passage + answer]))
                for a in range(0, len(ids) - passage - answer, passage)]
    return out[:n]


def timed(lm, instances, name: str) -> list:
    started = time.perf_counter()
    out = lm.loglikelihood(instances)
    seconds = time.perf_counter() - started
    print(f"| {name} | {len(instances)} | {seconds:.2f} | {len(instances) / seconds:.0f} |", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--run", required=True)
    p.add_argument("--export", help="a `dipaco export` of one of the run's paths (also --path)")
    p.add_argument("--path", help="the exported path's id (default: the run's first path)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--passage", type=int, default=48)
    p.add_argument("--answer", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    from lm_eval.api.instance import Instance

    from dipaco.eval.harness import DipacoLM

    probe = DipacoLM(run=args.run, progress=False)
    path = args.path or probe.rr.paths[0]
    instances = [Instance("loglikelihood", {}, r, i)
                 for i, r in enumerate(requests(probe.rr, args.passage, args.answer, args.requests))]
    probe.close()
    print("| model | requests | seconds | requests/s |\n| --- | ---: | ---: | ---: |")
    pinned = None
    for name, kw in (("dipaco, the run's once rule", {}), ("dipaco, shard router", {"routing": "shard"}),
                     ("dipaco, shard router, one request per pass", {"routing": "shard", "batch_size": 1}),
                     (f"dipaco, path {path}", {"path": path})):
        lm = DipacoLM(run=args.run, progress=False, **kw)
        try:
            out = timed(lm, instances, name)
        finally:
            lm.close()
        pinned = out if "path" in kw else pinned
    if args.export:
        from lm_eval.models.huggingface import HFLM

        hf = HFLM(pretrained=args.export, dtype="float32", device="cpu", batch_size=32)
        out = timed(hf, instances, f"hf on the export of path {path}")
        delta = np.abs(np.array([a[0] for a in pinned]) - np.array([b[0] for b in out])).max()
        print(f"\nlargest |log-likelihood difference| between dipaco path {path} and hf: {delta:.2e}")


if __name__ == "__main__":
    main()
