"""The environment of a process the fault tests start: the hooks of tests/fault_hooks/ loaded in it and in every process
it starts, Ray workers included (see tests/fault_hooks/dipaco_faults.py for the delays a test can ask for)."""

from __future__ import annotations

import os
from pathlib import Path

HOOKS = Path(__file__).resolve().parent / "fault_hooks"


def fault_env(delays: str, markers: Path) -> dict[str, str]:
    """Variables that arm ``delays`` (``DIPACO_FAULTS`` syntax); each delay that fires leaves its marker
    (``<name>.pid``, holding the sleeping process's id) in ``markers``."""
    markers.mkdir(parents=True, exist_ok=True)
    python_path = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": python_path, "DIPACO_FAULTS": delays, "DIPACO_FAULTS_DIR": str(markers),
            "RAY_RUNTIME_ENV_HOOK": "dipaco_faults.runtime_env"}
