"""Errors a user can fix. The CLI prints them as one line (no traceback) and exits 1."""


class UserError(Exception):
    """Base class: bad input data, an unreachable source, a missing API key variable, a spent budget."""


class DataError(UserError):
    """A source or data file is unreadable, has wrong columns, or fails validation (names file/row/field)."""


class DiskFull(UserError):
    """A write does not fit, or did not fit, on its file system: the message names the path, the free space there
    and, where the stage checked first, what it needed (pipeline/disk_space.py)."""


class EnvironmentUnavailable(UserError):
    """The environment (large LLM) endpoint cannot be started, reached, or paid for."""


class BudgetExceeded(UserError):
    """The configured environment budget (USD) is spent; the run stopped cleanly."""


class EnvironmentUnhealthy(UserError):
    """Too many environment calls failed in a row window (`environment.max_failure_rate`): training would learn
    from error notes instead of replies, so the run stops; the last good checkpoint stays."""


class TrainingUnhealthy(UserError):
    """The training health gate (`train.health`, pipeline/train/health_gate.py) saw a breach: the run stops with one
    line naming the figure, its value, the threshold and the step; the last healthy checkpoint is kept."""


class TrainingStalled(UserError):
    """The progress watchdog (pipeline/train/verl/watchdog.py) saw no new verl step line within the step's bound:
    verl's process group was stopped; the last checkpoint stays, so a retry resumes from it."""


class TrainingIncomplete(UserError):
    """verl ended without training the steps it should have from the checkpoint it resumed from (a restart at
    step 0, a skipped epoch, a short run); the message names the expected and the logged steps."""
