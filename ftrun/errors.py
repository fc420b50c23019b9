"""The errors ftrun reports to its user, and the exit codes they map to."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What the ``ftrun`` process returns; documented in the man page."""

    OK = 0
    #: the job failed: a worker failed and the retry budget was spent, or a node was lost
    JOB_FAILED = 1
    #: bad input: a flag, config value, script or address that cannot work
    USAGE = 2
    #: the rendezvous did not complete: endpoint unreachable or nodes missing at the deadline
    RENDEZVOUS = 3
    #: a device is unusable: ``ftrun probe``, ``--preflight``, or no usable device left for a rank
    DEVICE = 4
    #: stopped by SIGINT (Ctrl-C)
    INTERRUPTED = 130
    #: stopped by SIGTERM
    TERMINATED = 143


#: what a rank under ftrun.elastic exits with when a setting makes it fail whatever is retried (a snapshot
#: larger than its share of --snapshot-memory): the controller ends the job instead of restarting it
WORKER_SETTING_EXIT = 78
#: what a rank exits with when it could not leave a blocked collective after a repair was announced (the
#: repair then replaces it instead of waiting for it)
EXIT_STUCK = 75


class FtrunError(Exception):
    """A problem to tell the user in one line, with the exit code to leave with."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.USAGE):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class UsageError(FtrunError):
    """Bad input: a flag, config value, script or address."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.USAGE)


class RendezvousError(FtrunError):
    """The nodes could not gather: unreachable endpoint, missing nodes, rank clash."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.RENDEZVOUS)
