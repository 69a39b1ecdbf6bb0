"""The Ray engine (``--engine ray``): DiPaCo's task queue of phases on shared storage.

  ``ray_engine.py``   the driver (``TaskQueue``): its main loop launches what is ready, finishes what returns;
  ``schedule.py``, ``resolver.py``, ``rounds.py``, ``specs.py``: its parts without Ray (what to launch when, what
                      storage holds, finished rounds -> metrics and checkpoints, the tasks' specs)
  ``phases.py``       the task bodies, without Ray: a phase, an outer step, a validation
  ``taskstore.py``    where the queue lives in storage (phase outputs, module versions, commit records)
  ``runstore.py``     a run in a bucket: lineage, assembled checkpoints, local copies
  ``lease.py``, ``supervise.py``: one driver per run; --keep-going's supervisor
  ``ray_cluster.py``, ``ray_tasks.py``: joining or starting a cluster; plain retried tasks (the shard stage's blocks)

Ray is imported here only: ray_cluster.py, ray_engine.py and ray_tasks.py.
"""
