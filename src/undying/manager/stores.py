"""The job's c10d stores, listening on the job's address only.

A ``TCPStore`` server binds every interface (``0.0.0.0`` and ``::``) whatever
host name it is given. The manager's control store and each generation's
rendezvous store hold what the control plane relies on (the current
generation, which process owns which rank, the peers' gloo addresses), so they
must not be reachable from networks the job does not use: the manager binds the
listening socket itself, on the address it was told to listen on (loopback for
a single-node job), and hands it to the store (``master_listen_fd``), which
then owns it.

What this does not do is authenticate the store's clients: anyone who can reach
that address and port can talk to the store (docs/security.md says what that
means and what an operator must do about it).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

__all__ = ["bound_store"]

_BACKLOG = 512


def bound_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server listening on ``host``:``port`` (0: any free port) and nowhere else.

    Raises OSError when the address cannot be bound (in use, not this host's).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store closes it when it is destroyed
    return dist.TCPStore(host, bound_port, None, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=fd)
