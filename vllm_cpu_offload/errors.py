"""The error every bad user input for the host tier raises.

A module of its own, importing nothing, so that the configuration, the policy registry
and the tier directory's checks can all raise it without importing each other.
"""

from __future__ import annotations

GIB = 1 << 30


class OffloadConfigError(ValueError):
    """Bad user input for the host tier; the message is one line and names the fix."""
