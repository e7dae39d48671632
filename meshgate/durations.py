"""One spelling of a duration for every config key and flag that takes one (issue #31):
seconds as a number (``600``, ``1.5``), or a number and one unit, ``s``, ``m``, ``h`` or
``d``: ``"600s"``, ``"10m"``, ``"1.5h"``, ``"1d"``. The config's ``[cluster] retention``
and the CLI's ``--ttl`` read it here, so what one takes the other takes too.

A standard library parser would be welcome, but Python has none; the third-party ones
(humanfriendly, pytimeparse) take far more spellings than a config should (``"2 weeks"``),
and one regular expression says exactly what is taken.
"""

from __future__ import annotations

import math
import re
from typing import Any

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*")
SPELLINGS = 'a positive number of seconds or a duration like "600s", "10m", "1.5h", "1d"'


class DurationError(ValueError):
    """Not a duration; the message names the key or flag and the value."""


def parse_duration(value: Any, name: str) -> float:
    """Seconds from ``value`` (a number, or a string as the module says); ``name`` is the
    config key or flag the value came from, for the error."""
    seconds: Any = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = value
    elif isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match is not None:
            seconds = float(match.group(1)) * UNITS[match.group(2) or "s"]
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:61] + "..."
        raise DurationError(f"{name} must be {SPELLINGS}, got {shown}")
    return float(seconds)


__all__ = ["DurationError", "SPELLINGS", "UNITS", "parse_duration"]
