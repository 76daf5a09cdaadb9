"""The errors raised while finding, fetching and reading checkpoints."""

from __future__ import annotations

from minilade.config import UnsupportedModelError


class CheckpointError(ValueError):
    """A checkpoint cannot be found, fetched or read.

    Invariant: the message is a single line that names the file (or repo, or package) and the problem, so the CLI
    can print it as is and exit non-zero.
    """


class UnsupportedCheckpointError(CheckpointError, UnsupportedModelError):
    """The checkpoint is readable but describes a model minilade cannot run (architecture, option, tensor type).

    It is both kinds of error, so callers catching either CheckpointError or UnsupportedModelError see it.
    """


def one_line(error: BaseException | str) -> str:
    """A third-party error message folded onto one line (hub and pip errors span several)."""
    return " ".join(str(error).split())
