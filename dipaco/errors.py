"""The one exception type a user sees as a one-line message (exit code 2)."""


class DipacoError(Exception):
    """A problem with the user's input: the message names what is wrong and how to fix it."""
