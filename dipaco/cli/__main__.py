"""``python -m dipaco.cli ARGS`` is ``dipaco ARGS`` (torchrun's workers and the --keep-going supervisor's driver)."""

import sys

from dipaco.cli.commands import main

sys.exit(main())
