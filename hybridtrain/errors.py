"""User-facing errors: one clear line that names the problem and the fix, never a traceback."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line). The message is printed as one line.

    ``same_on_all_ranks`` marks errors every rank detects identically (config, dataset scan);
    only rank 0 prints those, so a 2-rank job shows the line once.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = True):
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


class PeerFailure(Exception):
    """Another rank died or failed; the message names it when this rank can tell (see distributed.departed).
    ``announce``: this rank prints the line (the lowest surviving rank on its host)."""

    def __init__(self, message: str, announce: bool = True):
        super().__init__(message)
        self.announce = announce
