"""Python runs this at start-up in every process whose PYTHONPATH holds this folder (tests/faults.py puts it there
for the processes a fault test starts): it arms the fault hooks of ``dipaco_faults`` when the test asked for any."""

import os

if os.environ.get("DIPACO_FAULTS"):
    import dipaco_faults

    dipaco_faults.install()
