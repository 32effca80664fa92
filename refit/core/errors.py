"""One exception type for bad input: the CLI prints its message as a single line and exits 2."""


class RefitError(Exception):
    """A user-facing error: bad input, a failed gate, a stale engine. The message is one line."""


class Stopped(KeyboardInterrupt):
    """A command ended by a signal: SIGTERM (a scheduler, ``kill``) is raised as this, as Ctrl-C raises
    KeyboardInterrupt, so every ``finally`` runs (temporary folders removed, locks released) and the command line
    says what was kept. ``kept``: set by the job that was running (its folder, its last checkpoint, how to go on)."""

    def __init__(self, signal_name: str = "SIGTERM"):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.kept = ""
