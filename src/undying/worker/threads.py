"""Background threads of a worker that are stopped before the interpreter finalizes.

A daemon thread that calls into torch (the heartbeat reads the group's
collective count, a call that releases the GIL) must not be inside that call
when the interpreter finalizes: it cannot take the GIL back, Python ends it
from inside C++ code that may not unwind, and the process aborts with SIGABRT
after a run that otherwise ended cleanly. An ``atexit`` callback runs before
finalization begins, so stopping and joining the thread there closes the window.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

__all__ = ["StoppedAtExit"]

log = logging.getLogger(__name__)


class StoppedAtExit:
    """Runs ``loop(stop)`` in a daemon thread; ``loop`` returns once ``stop`` is set.

    ``stop()`` sets it and waits for the thread; it is also called at
    interpreter exit. The thread stays a daemon, so a loop stuck in a call
    cannot keep a process from exiting: past ``join_s`` it is left behind.
    """

    def __init__(self, loop: Callable[[threading.Event], None], *, name: str,
                 join_s: float = 5.0) -> None:
        self.stopped = threading.Event()
        self._join_s = join_s
        self._thread = threading.Thread(target=loop, args=(self.stopped,), name=name, daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self.stopped.set()
        if self._thread is threading.current_thread():
            return
        self._thread.join(self._join_s)
        if self._thread.is_alive():
            log.warning("thread %s did not stop within %.0fs; left behind", self._thread.name,
                        self._join_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()
