"""The worker's line to its agent: reports out, commands in.

Reports are written synchronously from the training thread: a few hundred
bytes on a local socket, tens of microseconds, and a report sent before a
crash is never lost in a queue. Commands are read by a daemon thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from undying.protocol.channel_key import hello_line
from undying.protocol.codec import Message
from undying.protocol.worker_wire import WorkerCommand, decode_to_worker, encode

__all__ = ["AgentChannel"]

log = logging.getLogger(__name__)


class AgentChannel:
    def __init__(self, host: str, port: int, on_command: Callable[[WorkerCommand], None]) -> None:
        self._sock = socket.create_connection((host, port), timeout=30)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(hello_line())  # the agent listens only to processes that know its key
        self._lock = threading.Lock()
        self._on_command = on_command
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="undying-agent-channel",
                                        daemon=True)
        self._reader.start()

    def send(self, message: Message) -> None:
        data = encode(message)
        with self._lock:
            if self._closed:
                return
            try:
                self._sock.sendall(data)
            except OSError as e:
                # The agent is gone; the parent-death signal ends this process soon.
                log.debug("agent channel send failed: %s", e)
                self._closed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    self._on_command(decode_to_worker(line))
                except Exception:  # a bad command must not kill the training process
                    log.exception("bad command from agent: %r", line[:200])
