"""Numbers as a person reads them, for every summary the command line prints."""

from __future__ import annotations

__all__ = ["duration"]


def duration(seconds: float | None) -> str:
    """Seconds as a person reads them: 0.42 s, 41.2 s, 12 min 5 s, 3 h 4 min."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
