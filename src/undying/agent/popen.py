"""A worker started as a fresh interpreter (no zygote), watched by the agent's event loop."""

from __future__ import annotations

import asyncio
import os
import subprocess

from undying.agent.children import WATCHED

__all__ = ["PopenProcess"]


class PopenProcess:
    """A ``subprocess.Popen`` with an awaitable ``wait`` (a pidfd watched by the loop)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._done = asyncio.get_running_loop().create_future()
        WATCHED.add(self.pid)  # (until its exit is read: never taken for an orphan of a rank's)
        self._done.add_done_callback(lambda _: WATCHED.discard(self.pid))
        self._watch()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            loop.create_task(self._poll())
            return

        def ready() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._popen.wait()
            if not self._done.done():
                self._done.set_result(self._popen.returncode)

        loop.add_reader(fd, ready)

    async def _poll(self) -> None:
        while self._popen.poll() is None:
            await asyncio.sleep(0.01)
        self._done.set_result(self._popen.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)
