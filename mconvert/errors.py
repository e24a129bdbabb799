"""The one exception type the command line turns into a clean message (no traceback)."""

from __future__ import annotations


class ConvertError(Exception):
    """A problem with the user's input: a file, a tensor, an option. The message says what to do next."""


def format_names(names, limit: int = 12) -> str:
    """`a, b, c … (N more)`: for error messages that list tensors or files."""
    names = list(names)
    shown = ", ".join(str(n) for n in names[:limit])
    return shown + (f" … ({len(names) - limit} more)" if len(names) > limit else "")
