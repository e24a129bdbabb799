"""The exception the `mtrain` command line turns into a clean message (no traceback)."""

from __future__ import annotations

from mconvert.errors import ConvertError


class TrainError(ConvertError):
    """A problem with the user's input: a config field, a data file, a checkpoint. The message says what to do."""
