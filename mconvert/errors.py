"""The one exception type the command line turns into a clean message (no traceback)."""

from __future__ import annotations


class ConvertError(Exception):
    """A problem with the user's input: a file, a tensor, an option. The message says what to do next."""


def format_names(names, limit: int = 12) -> str:
    """`a, b, c … (N more)`: for error messages that list tensors or files."""
    names = list(names)
    shown = ", ".join(str(n) for n in names[:limit])
    return shown + (f" … ({len(names) - limit} more)" if len(names) > limit else "")


def mismatch(missing=(), extra=(), wrong=(), wrong_label: str = "Wrong shapes") -> str:
    """`Missing tensors: … Extra tensors: … <wrong_label>: …` — every difference in one message ("" if none)."""
    missing, extra, wrong = list(missing), list(extra), list(wrong)
    parts = []
    if missing:
        parts.append(f"Missing tensors: {format_names(missing)}.")
    if extra:
        parts.append(f"Extra tensors: {format_names(extra)}.")
    if wrong:
        parts.append(f"{wrong_label}: " + "; ".join(wrong[:6]) + (f" … ({len(wrong) - 6} more)" if len(wrong) > 6
                                                                  else "") + ".")
    return " ".join(parts)
