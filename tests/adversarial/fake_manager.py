"""A stranger's listener posing as a job's manager, writing down every byte it is sent.

Run by test_f1_shared_machine.py in a forked child that became another user
(``serve``), or as ``fake_manager.py JOB_ID [HOST:PORT]``. It writes its
port, then one JSON line per chunk it receives (``{"conn": n, "data":
...}``, the bytes as Latin-1). Without a target it answers like a manager
would: a hello gets a made-up proof, anything else ``200 {}``, so a client
that sends its token after a failed proof would look as if it worked. With a
target it relays each connection to it both ways: the real manager's proof
then reaches the client, made for the relay's own connection.

Standard library only.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading

_LOCK = threading.Lock()


_OUT = {"fd": 1}


def say(line: str) -> None:
    with _LOCK:
        os.write(_OUT["fd"], (line + "\n").encode())


def record(conn: int, data: bytes) -> None:
    say(json.dumps({"conn": conn, "data": data.decode("latin-1")}))


def pose(conn: int, sock: socket.socket, job_id: str) -> None:
    buffered = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return
        record(conn, chunk)
        buffered += chunk
        while b"\r\n\r\n" in buffered:
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            buffered = buffered[length:]
            hello = head.split(b" ", 2)[1].startswith(b"/api/hello")
            peer = sock.getpeername()
            body = json.dumps({"job_id": job_id, "peer": f"{peer[0]}|{peer[1]}", "proof": secrets.token_hex(32)}
                              if hello else {}).encode()
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)


def relay(conn: int, sock: socket.socket, target: tuple[str, int]) -> None:
    upstream = socket.create_connection(target, timeout=10)

    def back() -> None:
        while chunk := upstream.recv(65536):
            sock.sendall(chunk)
        sock.close()

    threading.Thread(target=back, daemon=True).start()
    while chunk := sock.recv(65536):
        record(conn, chunk)
        upstream.sendall(chunk)
    upstream.close()


def serve(job_id: str, relay_to: str | None, out_fd: int) -> None:
    """Listen on loopback, write the port and then what arrives to ``out_fd``; forever."""
    _OUT["fd"] = out_fd
    target = None
    if relay_to:
        host, port = relay_to.rsplit(":", 1)
        target = (host, int(port))
    server = socket.create_server(("127.0.0.1", 0))
    say(str(server.getsockname()[1]))
    n = 0
    while True:
        sock, _ = server.accept()
        n += 1
        args = (n, sock, target) if target else (n, sock, job_id)
        threading.Thread(target=relay if target else pose, args=args, daemon=True).start()  # type: ignore[arg-type]


if __name__ == "__main__":
    try:
        serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, 1)
    except KeyboardInterrupt:
        os._exit(0)
