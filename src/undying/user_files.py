"""Files and folders the user names: opened, or checked, before anything is created.

A file the user names (a training script, a ``--token-file``) is opened by
``open_user_file`` and nothing else: without blocking (a FIFO would wait
forever for a writer) and refused unless it is a regular file. A folder option
(``--log-dir``, ``--trace-dir``, ``--job-dir``) is checked by ``check_folder``.

Each refusal is a ``UsageError``, which the CLI prints as one line and exits 2.
The other checks of what a user types (job ids, numbers, addresses) are ``undying.inputs``.
"""

from __future__ import annotations

import errno
import os
import stat

from undying.errors import UsageError
from undying.inputs import quoted

__all__ = ["open_regular", "open_user_file", "check_folder"]


def _shown_path(path: str) -> str:
    """A path as an error line shows it: as it is when printable ASCII of a sane length, else as
    ``quoted``."""
    return path if path.isascii() and path.isprintable() and len(path) <= 300 else quoted(path)


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> int:
    """A descriptor of ``path`` opened for reading when it is a regular file; else ``OSError``
    (its strerror says why).

    Opened without blocking, so a FIFO (which blocks an ordinary open until a
    writer comes) is seen and refused at once; the descriptor is blocking again
    when it is returned. ``follow=False`` refuses a symbolic link (ELOOP).
    For a file read while a job runs (a watched switch file), where a refusal
    is reported and the job goes on; ``open_user_file`` for a command's input.
    """
    flags = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
             | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise OSError(errno.EINVAL, f"it is {kind}, not a file", os.fspath(path))
    os.set_blocking(fd, True)
    return fd


def open_user_file(path: str | os.PathLike[str], what: str, fix: str, *,
                   follow: bool = True) -> int:
    """``open_regular`` for a file a command's user names: a refusal is one line, ``what``, why,
    and ``fix``."""
    shown = _shown_path(os.fspath(path))
    try:
        return open_regular(path, follow=follow)
    except FileNotFoundError:
        raise UsageError(f"{what} {shown} does not exist; {fix}") from None
    except OSError as e:
        if e.errno == errno.EINVAL and str(e.strerror).startswith("it is "):
            raise UsageError(f"{what} {shown} is {str(e.strerror)[6:]}; {fix}") from None
        raise UsageError(f"cannot read {what} {shown} ({e.strerror or e}); {fix}") from None


def check_folder(option: str, path: str | os.PathLike[str]) -> str:
    """``path`` when it is a folder or can be made one (its nearest existing ancestor is a
    folder); else one line.

    A folder option given a file (``--log-dir``, ``--trace-dir``, ``--job-dir``) failed in every
    rank, or not at all, long after the start: now before anything is created.
    """
    text = os.fspath(path)
    here = os.path.abspath(text)
    while not os.path.lexists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        where = "" if here == os.path.abspath(text) else f" ({_shown_path(here)} is not)"
        raise UsageError(f"{option} {_shown_path(text)} is not a folder{where}; pass a folder "
                         "(created if missing)")
    return text
