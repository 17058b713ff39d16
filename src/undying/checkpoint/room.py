"""A full checkpoint folder: make room by pruning older checkpoints, then try the save once more.

Retention (``prune``) runs after a successful save, so on a full disk it never
ran again: every later save failed, and the dying gasp with it. A save that
fails for lack of room (ENOSPC, or EDQUOT over a quota) therefore deletes the
older checkpoints first, down to the newest valid one (``prune`` with
``keep=1``, which checksums before it deletes and never removes the checkpoint
``latest_valid`` would return), plus write leftovers, and tries once more. A
save that still fails raises as before: the caller reports it, with the OS's
own words.

Only the replicated writer (one rank owns the root) makes room itself; a
sharded save is collective, and one rank deleting while the others write
would race, so there retention stays after the commit.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import TypeVar

from undying.checkpoint.discovery import prune
from undying.checkpoint.store import Store

__all__ = [
    "NO_ROOM_ERRNOS", "os_error_of", "is_out_of_space", "describe_os_error", "make_room",
    "with_room",
]

log = logging.getLogger("undying.checkpoint")

# The OS's ways of saying "no room": the device is full, or the user's quota is.
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# A ``.tmp-step-*`` folder untouched this long is no write in progress (one writer per root;
# the failed write already removed its own): under pressure it goes at once, not after an hour.
_TMP_STALE_S = 10.0

T = TypeVar("T")


def _os_errors(exc: BaseException) -> list[OSError]:
    """The OSErrors in ``exc``'s cause/context chain, outermost first."""
    seen: set[int] = set()
    found: list[OSError] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            found.append(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return found


def os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (itself, or in its cause/context chain), if any: a storage
    failure."""
    found = _os_errors(exc)
    return found[0] if found else None


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause/context chain) is the OS saying there is no room left."""
    return any(e.errno in NO_ROOM_ERRNOS for e in _os_errors(exc))


def describe_os_error(exc: BaseException) -> str:
    """What the OS said behind ``exc``, as ``ENOSPC: No space left on device``; "" when no OSError
    is in it.

    The symbolic name is what an operator greps for and a dashboard groups by;
    the text is what a person reads.
    """
    for e in _os_errors(exc):
        if e.errno is not None:
            name = errno.errorcode.get(e.errno, f"errno {e.errno}")
            return f"{name}: {e.strerror or os.strerror(e.errno)}"
    found = _os_errors(exc)
    return f"{type(found[0]).__name__}: {found[0]}" if found else ""


def make_room(store: Store) -> list[str]:
    """Delete every checkpoint but the newest valid one, and stale write leftovers; the names
    removed.

    ``prune(keep=1)``: the newest checkpoint whose checksums pass is kept,
    whatever ``--keep`` says; a folder newer than it that is broken stays
    (it may be a commit in progress, and prune never guesses).
    """
    try:
        removed = prune(store, 1, tmp_max_age_s=_TMP_STALE_S)
    except OSError as e:
        # Nothing deleted is no worse than before; the save's own error is what is told
        log.warning("making room under %s failed: %s", store.url_of(store.root), e)
        return []
    if removed:
        log.warning("checkpoint folder %s is full: removed %s to make room (the newest valid "
                    "checkpoint is kept)", store.url_of(store.root), ", ".join(removed))
    return removed


def with_room(
    store: Store, save: Callable[[], T], *, on_pruned: Callable[[list[str]], None] | None = None
) -> T:
    """``save()``; when it fails for lack of room, ``make_room`` and ``save()`` once more.

    The second failure (or a first that is not about room) propagates
    unchanged. ``on_pruned`` hears what was removed (nothing: no second try,
    the same write would fail the same way).
    """
    try:
        return save()
    except Exception as e:
        if not is_out_of_space(e):
            raise
        removed = make_room(store)
        if not removed:
            raise
        if on_pruned is not None:
            on_pruned(removed)
    return save()
