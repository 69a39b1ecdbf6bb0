"""What dipaco keeps on disk or in a bucket, and the rules for writing it.

  ``shards.py``      the shard-directory format (its one owner: layout, manifest, fingerprint, reader, writer)
  ``run.py``         the run directory: its lifecycle while it trains (round 0 included) and the trained run read back
  ``checkpoint.py``  a round's checkpoint: modules, optimizer and data state, ``latest``
  ``objects.py``     one storage interface over local paths and fsspec URLs (``create_if_absent``: the commit)
  ``outputs.py``     what every command checks before it writes
"""
