"""The errors shmchan.spark raises itself (a Spark job's own failures stay Spark's)."""

from __future__ import annotations

from ..errors import Error

__all__ = ["ColumnError"]


class ColumnError(Error, ValueError):
    """A column named in the call is missing, or its type cannot be used for what was asked
    (keys must be strings, integers or binary, or arrays of them)."""
