"""SI prefixes for the numbers moejax prints (console lines, planner tables)."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si_prefix(x: float) -> tuple[float, str]:
    """(x scaled, its prefix): 9870.0 -> (9.87, 'k'); below 1000 -> (x, '')."""
    for scale, prefix in _PREFIXES:
        if abs(x) >= scale:
            return x / scale, prefix
    return x, ""
