"""A stranger on the job's network: what it can read or change on every port it reaches.

Run inside another host (network namespace) by test_f1_strangers.py with the
targets as JSON (``[[address, port], ...]``); prints one JSON object per target
saying what each attempt got. It holds no token and no key: it tries raw bytes,
the HTTP API without a token, c10d's own ``TCPStore`` client (read and write the
keys the job uses and random ones), and undying's store protocol under a wrong
key. Every attempt is bounded (a few seconds), and targets are tried side by
side so the job is still training when the stranger is done.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from undying.protocol.store_client import JobStore

JOB_KEYS = ["gen/current", "gen/0", "gen/1", "rank/0/owner", "rank/1/owner", "default_pg/0//cpu//0/rank_0"]
STORES = ["control", *(f"gen/{n}" for n in range(6))]
TIMEOUT = timedelta(seconds=1)
DEADLINE_S = 8.0


def raw(address: str, port: int) -> dict[str, Any]:
    try:
        with socket.create_connection((address, port), timeout=2) as s:
            s.sendall(os.urandom(256))
            s.settimeout(1.5)
            try:
                answer = s.recv(64)
            except OSError:
                answer = b""
            return {"connected": True, "answered": len(answer)}
    except OSError as e:
        return {"connected": False, "error": str(e)}


HTTP_CALLS = [("GET", "/api/status", None), ("GET", "/api/ranks", None),
              ("POST", "/api/inject", json.dumps({"kind": "crash", "rank": 0})), ("POST", "/api/stop", "{}")]


def http_call(address: str, port: int, method: str, path: str, body: str | None) -> int | str:
    """The HTTP status of one API call made without a token (a string when no HTTP answer came)."""
    try:
        conn = http.client.HTTPConnection(address, port, timeout=2)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return status
    except (OSError, http.client.HTTPException) as e:
        return f"error: {type(e).__name__}"


def tcpstore(address: str, port: int) -> dict[str, Any]:
    """c10d's own client: what it reads and what it writes, if it gets that far."""
    done: dict[str, Any] = {"read": [], "wrote": []}
    try:
        store = dist.TCPStore(address, port, None, False, timeout=TIMEOUT)
    except Exception as e:
        done["connect"] = f"{type(e).__name__}: {str(e)[:120]}"
        return done
    done["connect"] = "ok"
    for key in JOB_KEYS + ["stranger/random"]:
        try:
            store.get(key)
            done["read"].append(key)
        except Exception:
            pass
    for key, value in [("rank/1/owner", "999"), ("gen/current", "77"), ("stranger/random", "x")]:
        try:
            store.set(key, value)
            done["wrote"].append(key)
        except Exception:
            pass
    return done


def wrong_key_on(address: str, port: int, name: str) -> dict[str, Any]:
    """undying's store protocol on store ``name``, under a key that is not the job's."""
    done: dict[str, Any] = {"read": [], "wrote": [], "errors": []}
    try:
        store = JobStore(address, port, name, os.urandom(32), TIMEOUT)
    except Exception as e:
        done["errors"].append(f"{type(e).__name__}: {str(e)[:120]}")
        return done
    for key in JOB_KEYS:
        try:
            store.get(key)
            done["read"].append(f"{name}:{key}")
        except Exception:
            pass
    try:
        store.set("rank/1/owner", "999")
        done["wrote"].append(f"{name}:rank/1/owner")
    except Exception:
        pass
    return done


def timed(fn: Any, *args: Any) -> Any:
    started = time.monotonic()
    result = fn(*args)
    if isinstance(result, dict):
        result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main() -> None:
    """Every attempt on every target side by side; what has not ended within ``DEADLINE_S`` is reported so.

    (c10d's TCPStore client retries a peer that resets it for about 20 s, whatever
    its timeout: on gloo's ports it is still retrying when the rest is done. It is
    left running, and the process exits without waiting for it.)
    """
    targets = [(str(a), int(p)) for a, p in json.loads(sys.argv[1])]
    pool = ThreadPoolExecutor(max_workers=64)
    attempts: dict[tuple[str, int], dict[str, Any]] = {
        target: {"raw": pool.submit(timed, raw, *target),
                 "http": {f"{m} {p}": pool.submit(http_call, *target, m, p, b) for m, p, b in HTTP_CALLS},
                 "tcpstore": pool.submit(timed, tcpstore, *target),
                 "wrong_key": [pool.submit(timed, wrong_key_on, *target, name) for name in STORES]}
        for target in targets
    }
    deadline = time.monotonic() + DEADLINE_S

    def result(future: Future[Any]) -> Any:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return {"read": [], "wrote": [], "errors": [], "unfinished": True}

    for (address, port), futures in attempts.items():
        wrong = [result(f) for f in futures["wrong_key"]]
        print(json.dumps({
            "target": f"{address}:{port}", "raw": result(futures["raw"]),
            "http": {call: result(f) for call, f in futures["http"].items()},
            "tcpstore": result(futures["tcpstore"]),
            "wrong_key": {k: [x for w in wrong for x in w.get(k, [])] for k in ("read", "wrote", "errors")},
        }), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
