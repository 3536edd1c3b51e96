"""Errors that cross the service boundary with a clear status code.

Engines raise these; the servers' interceptor maps them, so servicers need no
try/except of their own.
"""


class InvalidRequest(ValueError):
    """The caller sent something wrong: maps to INVALID_ARGUMENT with this message."""


class Unavailable(RuntimeError):
    """The service cannot take the request now (shutting down, out of KV pages)."""


class Overloaded(RuntimeError):
    """Too many requests wait already: maps to RESOURCE_EXHAUSTED (retry later)."""
