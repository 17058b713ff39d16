"""The verify/ folder's files under the job's MAC, and a verifier that keeps dying (issue #25)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from undying.protocol.codec import Message
from undying.protocol.env import CHECKPOINT_KEY_ENV, VERIFY_KEY_ENV
from undying.worker.verify import MAX_RESTARTS, Verification
from undying.worker.verify_files import (
    MAGIC,
    ForgedFile,
    key_for_verifier,
    load_sealed,
    save_sealed,
    seal,
    unseal,
    verify_key,
)

KEY = bytes(range(32))


def test_a_sealed_file_opens_under_the_job_key_only(tmp_path: Path) -> None:
    path = tmp_path / "res-1r0000-000000003.json"
    seal(path, b'{"a": 1}', KEY)
    assert unseal(path, KEY) == b'{"a": 1}'
    assert path.read_bytes().startswith(MAGIC) and not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(ForgedFile, match="fails the job's MAC"):
        unseal(path, bytes(32))  # another job's key
    moved = tmp_path / "res-1r0000-000000004.json"  # a genuine file put in another step's place
    moved.write_bytes(path.read_bytes())
    with pytest.raises(ForgedFile, match="moved from another name"):
        unseal(moved, KEY)
    changed = bytearray(path.read_bytes())
    changed[-2] ^= 1
    path.write_bytes(bytes(changed))
    with pytest.raises(ForgedFile, match="fails the job's MAC"):
        unseal(path, KEY)
    path.write_bytes(b'{"a": 1}')  # what a stranger writes: no MAC at all
    with pytest.raises(ForgedFile, match="carries no MAC of the job"):
        unseal(path, KEY)


def test_a_forged_state_is_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "pre-1r0000-000000001.pt"
    save_sealed(path, {"w": torch.ones(3)}, KEY)
    assert torch.equal(load_sealed(path, KEY)["w"], torch.ones(3))
    torch.save({"w": torch.zeros(3)}, path)  # a plain torch.save file in its place
    with pytest.raises(ForgedFile):
        load_sealed(path, KEY)


def test_the_verify_key_is_derived_and_the_verifier_gets_only_it() -> None:
    derived = verify_key(KEY)
    assert len(derived) == 32 and derived != KEY
    assert key_for_verifier({CHECKPOINT_KEY_ENV: KEY.hex()}) == derived  # a rank: from its checkpoint key
    assert key_for_verifier({VERIFY_KEY_ENV: derived.hex()}) == derived  # the verifier: its own
    assert key_for_verifier({}) is None and key_for_verifier({VERIFY_KEY_ENV: "zz"}) is None


class _DyingVerifier(Verification):
    """The real bookkeeping, with a verifier process that dies at once (exit 3), as a crash-looping one does."""

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_a_verifier_that_keeps_dying_is_restarted_then_given_up_on_with_the_reason(tmp_path: Path) -> None:
    sent: list[Message] = []
    verification = _DyingVerifier(1, rank=0, world=1, seed=0, job_dir=str(tmp_path), generation=lambda: 0,
                                  send=sent.append, key=KEY)
    verification.start()
    for _ in range(MAX_RESTARTS + 2):
        process = verification._process
        assert process is not None
        process.wait(timeout=30)
        verification._keep_verifier()
    phases = [getattr(m, "phase", "") for m in sent]
    assert phases == ["verify_started", *["verify_restarted"] * MAX_RESTARTS, "verify_gave_up"], phases
    detail: dict[str, Any] = getattr(sent[-1], "detail", {})
    assert f"died {MAX_RESTARTS + 1} times in a row without an answer (the last exit 3" in detail["reason"], detail
    assert "steps from here on are not verified" in detail["reason"]
    # From then on no step is verified, each counted as skipped, never as passed.
    decision = verification._ledger.decide(5, 0, [])
    assert not decision.issue and verification._ledger.skipped == 1
    verification.close()
    summary: dict[str, Any] = getattr(sent[-1], "detail", {})
    assert summary["restarts"] == MAX_RESTARTS and summary["gave_up"] == detail["reason"] and summary["passed"] == 0
    assert os.path.isdir(tmp_path / "verify")


def test_status_and_the_end_summary_show_the_steps_not_verified(tmp_path: Path) -> None:
    from undying.cli.summary import logged_verification, verification_line
    from undying.jobfiles.events import EventLog

    db = tmp_path / "events.db"
    log = EventLog(db)
    assert logged_verification(db, step=10) is None  # not asked: no line
    log.event("verify_started", every=2, pid=1)
    for step, passed in ((2, True), (4, True), (6, False)):
        log.event("verify_result", step=step, suspect=0, passed=passed)
    log.event("verify_restarted", pid=2, old_pid=1)
    log.flush()
    running = logged_verification(db, step=20)
    assert running is not None
    assert verification_line(running) == ("verification: every 2 steps: 3 of 10 due steps verified so far (1 "
                                          "mismatched), 7 not (yet) verified; the verifier was restarted 1 time")
    log.event("verify_gave_up", reason="the verifier died 4 times in a row")
    log.event("verify_summary", verified=3, passed=2, mismatched=1, skipped=5, not_done=1, errors=1, refused=2)
    log.flush()
    log.close()
    done = logged_verification(db, step=20)
    assert done is not None
    assert verification_line(done) == (
        "verification: every 2 steps: 3 verified (1 mismatched), 7 not verified (5 skipped: the verifier behind or "
        "down, 1 unanswered at the end, 1 could not be replayed); the verifier was restarted 1 time; given up: "
        "the verifier died 4 times in a row; 2 file(s) in verify/ refused (not the job's MAC)")
