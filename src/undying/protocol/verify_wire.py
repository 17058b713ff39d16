"""What a rank and the job's verifier exchange for ``--verify-every``: requests and verdicts, as
files.

The verifier (``undying.worker.verify``) is a process of the job's own script
outside the job's process group, so it meets the ranks through a folder of the
job dir (``verify/``), not a channel: one file per message, written whole and
renamed into place, read by the other side when it appears. The tensors a
replay needs (the pre-step state, the step's batch) travel beside these in
``torch.save`` files loaded with ``weights_only=True``.

Names of the files carry the *round* (the run of requests since rank 0 began or
last rolled back), so an answer to a request from before a roll-back is never
taken for one after it.
"""

from __future__ import annotations

from undying.protocol.codec import Codec, Message

__all__ = ["VerifyRequest", "VerifyResult", "VERIFY_CODEC", "file_name"]


class VerifyRequest(Message, frozen=True):
    """The suspect's side of a verification: its step, rank and local gradient fingerprint (the
    bits)."""

    round: str
    step: int
    rank: int  # the suspect: whose step is replayed
    # The rank whose pre-step state the replay starts from (another one when the job has two)
    holder: int
    seed: int  # the job's seed: the replay reseeds as that rank did for that step
    prints: list[int]
    t: float


class VerifyResult(Message, frozen=True):
    """The verifier's verdict: the replayed fingerprint equal to the suspect's, bit for bit, or
    not."""

    round: str
    step: int
    rank: int
    holder: int
    match: bool
    differing: list[int]  # which of the rank's gradients (in parameter order) differed
    replay_s: float  # how long the replay took
    t: float


VERIFY_CODEC: Codec[VerifyRequest | VerifyResult] = Codec(VerifyRequest | VerifyResult,
                                                          "verify folder")


def file_name(kind: str, round_: str, step: int, suffix: str) -> str:
    """``kind-round-step.suffix`` (kind: ``req`` and ``batch`` of the suspect, ``pre`` of the
    holder, ``res``)."""
    if not round_.isalnum():
        raise ValueError(f"a verification round is letters and digits, got {round_!r}")
    return f"{kind}-{round_}-{step:09d}.{suffix}"

