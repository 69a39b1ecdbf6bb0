"""Routing finds the five domains of the shared corpus (skips where ../shared is absent). The router reads
the first 32 tokens of a document; clustering whole documents and learning the clusters back from the
prefix gives purer paths than clustering the prefixes themselves."""

import gzip
import json

import pytest

from conftest import SHARED_CORPUS, shard_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"shared corpus not found at {SHARED_CORPUS}")]


@pytest.mark.parametrize("cluster_on", ["prefix", "document"])
def test_flat_router_purity_on_five_domains(tmp_path, cluster_on):
    from dipaco.sharding.writer import purity, shard

    slice_file = tmp_path / "slice.jsonl"
    with open(slice_file, "w", encoding="utf-8") as out:
        for f in sorted(SHARED_CORPUS.glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                for i, line in enumerate(fh):
                    if i >= 150:
                        break
                    out.write(line)
    cfg = shard_config("5", "routing.balance=0.0", "routing.svd_dims=64", "data.heldout_fraction=0.0",
                       f'routing.cluster_on="{cluster_on}"')
    manifest = shard([str(slice_file)], cfg, tmp_path / "shards", progress=False)
    labels = manifest["labels_per_path"]
    per_path = purity(labels)["per_path"]
    overall = purity(labels)["overall"]
    print(json.dumps(labels, indent=1), overall)
    assert manifest["route_agreement"]["heldout"] in (None, 1.0)  # the router that sharded is the one that answers
    if cluster_on == "document":  # paths defined on whole documents: nearly one domain each (0.90 measured)
        assert overall >= 0.85 and min(v for v in per_path.values() if v is not None) >= 0.75
    else:  # 32 tokens of tf-idf alone separate the domains less well (0.64 measured; chance is 0.2)
        assert overall >= 0.55
