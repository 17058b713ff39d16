"""The verifier's side of ``--verify-every``: the job's script again, serving replays instead of
training.

Rank 0 starts it (``worker.verify``) with the folder to serve and the job's
verify key in its environment; ``job.steps`` then yields its replays
(``serve``) instead of training steps. Every file it loads must carry the job's
MAC (``worker.verify_files``), and every verdict it writes is sealed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from undying.errors import UndyingError
from undying.protocol.codec import Message
from undying.protocol.env import VERIFY_KEY_ENV, VERIFY_SERVE_DIR_ENV
from undying.protocol.verify_wire import (
    VERIFY_CODEC,
    VerifyRequest,
    VerifyResult,
    file_name,
)
from undying.worker import rng
from undying.worker.numerics import Numerics
from undying.worker.numerics_guard import NumericsGuard
from undying.worker.step import Outcome, Step, StepHooks
from undying.worker.verify_files import (
    ForgedFile,
    key_for_verifier,
    load_sealed,
    seal,
    unseal,
)

__all__ = ["serve", "serving"]

log = logging.getLogger("undying.worker")

_POLL_S = 0.02


def serving() -> bool:
    """Whether this process is a job's verifier (rank 0 started it with the folder to serve)."""
    return bool(os.environ.get(VERIFY_SERVE_DIR_ENV))


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: the reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class _Replayed(UndyingError):
    """Raised at ``optimizer.step()`` in a replay: the fingerprint is taken, nothing steps."""


def _nowhere(message: Message) -> None:
    """The verifier reports to no one: its answers are files."""


def serve(state: Any, config: Numerics) -> Iterator[Step]:
    """The verifier's loop: each request's step, replayed from the holder's state on the
    suspect's batch.

    Each replay is a step the script's own body runs (``with step:``), stopped
    at ``optimizer.step()``; a numeric guard's gradient hooks take the
    fingerprint, as on the ranks. Ends when the rank 0 that started it (its
    parent) is gone. A request whose files cannot be read is answered as not
    replayed (``differing == [-1]``), never as a verdict.
    """
    folder = Path(os.environ[VERIFY_SERVE_DIR_ENV])
    key = key_for_verifier()
    if key is None:  # started by hand, not by rank 0: it could check nothing it loads
        log.error("verifier: no verify key (%s): it loads only files sealed by the job; leaving",
                  VERIFY_KEY_ENV)
        logging.shutdown()
        os._exit(2)
    parent = os.getppid()
    replaying = [False]
    # rank 0 waits for answers at the end only while this is up
    _write(folder / f"ready-{os.getpid()}", b"")

    def stop_at_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
        if replaying[0]:
            raise _Replayed("replayed up to optimizer.step()")

    if state.optimizer is not None:
        state.optimizer.register_step_pre_hook(stop_at_optimizer)
    # its gradient hooks take the fingerprint
    guard = NumericsGuard(config, state, 0, lambda: 0, _nowhere)
    hooks = StepHooks(before_commit=lambda step: False, commit=lambda step: None,
                      is_fault=lambda exc: False, aborted=lambda exc: None,
                      failed=lambda index, exc: None, began=lambda step, fp: None,
                      numeric=lambda step, exc: "replay" if isinstance(exc, _Replayed) else None)
    while os.getppid() == parent:
        found = sorted(folder.glob("req-*.json"))
        if not found:
            time.sleep(_POLL_S)
            continue
        path = found[0]
        loaded = _load_request(folder, path, key)
        if loaded is None:
            time.sleep(_POLL_S)  # the holder's state is still being written
            continue
        request, batch, pre, error = loaded
        started = time.monotonic()
        prints: list[int] = []
        if pre is not None:
            state.load_state_dict(pre)
            state.discard_gradients()
            rng.reseed(request.seed, request.rank, "body", request.step)
            step = Step(hooks, request.step, 0, batch, 0)
            guard.begin(step)
            replaying[0] = True
            try:
                yield step
            finally:
                replaying[0] = False
            if step.outcome is Outcome.REPLAY:
                prints = guard.prints()
            else:
                error = (f"the body of step {request.step} ended without optimizer.step() "
                         f"({step.outcome.value})")
        same = not error and prints == request.prints
        differing = [-1] if error else [i for i in range(max(len(prints), len(request.prints)))
                                        if prints[i:i + 1] != request.prints[i:i + 1]]
        result = VerifyResult(request.round, request.step, request.rank, request.holder, same,
                              differing, round(time.monotonic() - started, 6), time.time())
        if error:
            log.warning("verifier: step %d of rank %d not replayed: %s", request.step,
                        request.rank, error)
        seal(folder / file_name("res", request.round, request.step, "json"),
             VERIFY_CODEC.encode(result), key)
        for done in (path, folder / file_name("batch", request.round, request.step, "pt")):
            with contextlib.suppress(OSError):
                done.unlink()
    # Rank 0 is gone: leave now, never running the script's code after its loop (a final save, a
    # report) as if this process had trained.
    logging.shutdown()
    os._exit(0)


def _load_request(folder: Path, path: Path,
                  key: bytes) -> tuple[VerifyRequest, Any, Any, str] | None:
    """A request, its batch and the holder's state (None for the state, with why, when they
    cannot be read).

    None: the holder's state is not there yet (it is written from a thread);
    past a minute it is answered as not replayed. Every file must carry the
    job's MAC: a forged request is dropped unread, a forged state or batch
    answered as not replayed (never loaded).
    """
    try:
        request = VERIFY_CODEC.decode(unseal(path, key))
    except (OSError, ValueError, ForgedFile) as e:
        with contextlib.suppress(OSError):
            path.unlink()
        log.warning("verifier: request %s unreadable, dropped: %s", path.name, e)
        return None
    if not isinstance(request, VerifyRequest):
        return None
    pre = folder / file_name("pre", request.round, request.step, "pt")
    if not pre.exists():
        if time.time() - request.t < 60:
            return None
        return request, None, None, f"the holder's state {pre.name} never came"
    try:
        batch = load_sealed(folder / file_name("batch", request.round, request.step, "pt"), key)
        return request, batch, load_sealed(pre, key), ""
    # ForgedFile: never loaded; a file torn by a full disk, or refused by weights_only: not a
    # verdict
    except Exception as e:
        return request, None, None, f"{type(e).__name__}: {e}"
