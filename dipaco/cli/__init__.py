"""The top floor: the ``dipaco`` commands (``commands.py``: one thin subcommand per stage, the entry point ``main``),
the flags generated from the config sections (``flags.py``) and ``dipaco quickstart`` (``quickstart.py``).

Only this package imports the stages (``dipaco.sharding``, ``dipaco.eval``); ``python -m dipaco.cli`` runs ``dipaco``.
"""
