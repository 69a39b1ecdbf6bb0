"""Routing finds the five domains of the shared corpus (skips where ../shared is absent)."""

import gzip
import json

import pytest

from conftest import SHARED_CORPUS, shard_config

pytestmark = pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"shared corpus not found at {SHARED_CORPUS}")


def test_flat_router_purity_on_five_domains(tmp_path):
    from dipaco.sharding.writer import purity, shard

    slice_file = tmp_path / "slice.jsonl"
    with open(slice_file, "w", encoding="utf-8") as out:
        for f in sorted(SHARED_CORPUS.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                for i, line in enumerate(fh):
                    if i >= 150:
                        break
                    out.write(line)
    cfg = shard_config("5", "routing.balance=0.0", "routing.svd_dims=64", "data.heldout_fraction=0.0")
    manifest = shard([str(slice_file)], cfg, tmp_path / "shards", progress=False)
    labels = manifest["labels_per_path"]
    per_path = purity(labels)["per_path"]
    print(json.dumps(labels, indent=1))
    assert min(v for v in per_path.values() if v is not None) >= 0.8
