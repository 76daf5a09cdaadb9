"""Every error minilade raises for bad input, in one place.

Invariant: each message is a single line that names the file, option or value at fault and what is wrong, so
the CLI prints it as is (`error: ...`) and exits with status 2. All are ValueErrors, so a library caller can
catch ValueError for "the input was bad" and let anything else (a bug) propagate.
"""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model minilade cannot run (architecture, option or tensor type)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be found, fetched or read."""


class UnsupportedCheckpointError(CheckpointError, UnsupportedModelError):
    """The checkpoint is readable but describes a model minilade cannot run (architecture, option, tensor type).

    It is both kinds of error, so callers catching either CheckpointError or UnsupportedModelError see it.
    """


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or used: missing files, unsupported vocabulary, no or failing chat template."""


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (syntax error, `raise_exception`, bad message shape)."""


class TensorParallelError(ValueError):
    """A tensor-parallel run cannot go on: a rank failed, a peer did not answer in time, or the ranks disagree."""


def one_line(error: BaseException | str) -> str:
    """A third-party error message folded onto one line (hub, pip and parser errors span several)."""
    return " ".join(str(error).split()) or type(error).__name__
