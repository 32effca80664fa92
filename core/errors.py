"""One exception type for bad input: the CLI prints its message as a single line and exits 2."""


class RefitError(Exception):
    """A user-facing error: bad input, a failed gate, a stale engine. The message is one line."""
