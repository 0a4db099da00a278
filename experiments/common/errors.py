"""The error of a file or folder a run cannot use, and the errors an entry point reports as one line."""

from __future__ import annotations

from config import SettingError
from solver import PlanError


class InputError(ValueError):
    """A file or folder a run reads or writes that cannot be used: a trace, a token file, a results
    folder, an output folder, a checkpoint. The message names it and what is wrong."""


# what an entry point prints as "error: <message>" and exits on, before or instead of any work:
# a bad setting, a bad file, a step that cannot be planned
USER_ERRORS = (SettingError, InputError, PlanError)
