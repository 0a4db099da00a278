"""The one way every entry point reads its command line and reports a user's error.

    settings = entry.parse(COMMAND, argv)            # parsed and prepared (experiments.common.settings)
    with entry.user_errors():                        # any later step that can fail on the user's input
        check_output_dir(settings.bench.out)

A user's error (a bad setting, file or folder, a step that cannot be planned: USER_ERRORS) is one
line, "error: <what is wrong and what would be valid>", on standard error from rank 0 (the
launcher's RANK; every rank when unset), and exit code 2, whichever entry point it is. Anything
else is not the user's error: a bug (solver.cluster.InternalError and the rest), which keeps its
traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from config import SettingError
from config.cli import Command, Settings

from .errors import USER_ERRORS
from .settings import prepare

EXIT_USER_ERROR = 2  # argparse's own code for a bad command line: the same for every user error


class UserExit(SystemExit):
    """The exit of a user's error: code 2, printed once (str() is the line, for callers in-process)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = EXIT_USER_ERROR
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(e: BaseException | str, where: str = "") -> NoReturn:
    """Print the user's error as one line (rank 0 under a launcher) and exit with code 2."""
    line = f"error: {where}{e}"
    if int(os.environ.get("RANK", 0)) == 0:
        print(line, file=sys.stderr, flush=True)
    raise UserExit(line)


@contextlib.contextmanager
def user_errors(where: str = ""):
    """Inside it, a user's error ends the entry point as fail() does; `where` prefixes the line."""
    try:
        yield
    except USER_ERRORS as e:
        fail(e, where)


def parse(command: Command, argv=None, resolve_workload: bool = True) -> Settings:
    """The command line's settings, every value checked and completed for the run by
    experiments.common.settings.prepare (the sparse kind's defaults, the EP degree, the workload
    resolved for the cluster unless resolve_workload=False: an entry point that runs several
    clusters resolves it for each): the one parse every entry point runs."""
    with user_errors():
        settings = command.parse(argv)
        try:
            return prepare(settings, resolve_workload)
        except SettingError as e:  # a check across settings names each by the route its value came by
            raise SettingError(settings.reroute(str(e))) from None
