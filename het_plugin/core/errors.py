"""One error type for every bad input, so users always see the file, the field and the fix."""
from __future__ import annotations


class HetPluginError(Exception):
    """Base class of het_plugin's own errors."""


class ConfigError(HetPluginError, ValueError):
    """An input (cluster file, model file, plan, degrees) that cannot be used.

    Raised before any process group is created; the message names where the problem is
    (``source`` and ``field``) and what to do about it (``fix``).
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 fix: str | None = None):
        self.source = source
        self.field = field
        self.problem = message
        self.fix = fix
        where = ""
        if source:
            where += f"{source}: "
        if field:
            where += f"{field}: "
        text = where + message
        if fix:
            text += f"\n  fix: {fix}"
        super().__init__(text)


class PlanMismatchError(HetPluginError, RuntimeError):
    """Ranks computed different plans; raised on every rank, naming the ranks that differ."""
