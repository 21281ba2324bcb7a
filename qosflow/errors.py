"""Errors qosflow raises on bad input.

Every message names what was wrong, where (field, file and line) and, where it can, how to fix it.
The CLI prints these without a traceback and exits with status 2.
"""

from __future__ import annotations


class QosflowError(Exception):
    """Base class of every error qosflow raises about user input or configuration."""


class SpecError(QosflowError, ValueError):
    """A QoS spec, job, cluster or placement is invalid. The message names the field."""

    def __init__(self, field: str, message: str, *, where: str | None = None):
        self.field = field
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}invalid {field}: {message}")


class NotEnoughData(QosflowError, ValueError):
    """A model has no row to learn from (e.g. every training job is a reference job of the profile);
    callers fall back or skip, and the message says what was missing."""


class TraceFormatError(QosflowError, ValueError):
    """A trace or table file is malformed. The message names the file and line."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        loc = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{loc}: {message}")


class UnknownNameError(QosflowError, KeyError):
    """A policy, format or model name that qosflow does not know."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]):
        self.kind, self.name, self.known = kind, name, list(known)
        super().__init__(f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(self.known))}")

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return self.args[0]


def closest_name(name: str, known: "list[str] | tuple[str, ...]") -> str | None:
    """The known name a misspelt `name` most likely meant (for a did-you-mean), or None."""
    import difflib

    close = difflib.get_close_matches(str(name), list(known), n=1)
    return close[0] if close else None
