"""A stranger who can write the job's ``verify/`` folder (another local user, a shared folder): run as a process.

``python -m tests.adversarial.forger FOLDER COUNT SECONDS``: for each of the
first COUNT pre-step states the job writes there, it plants what made every
rank load a forged state before (issue #25): the state itself replaced by one
with every tensor zeroed (read by skipping whatever header the file has, as a
stranger can), and a verdict of a mismatch for that step (so that the job rolls
back to it), and one more under a step no verifier answers (so one forged verdict
is there to be read whatever the race with the verifier). It holds no key: it writes plain ``torch.save`` files and plain
messages, and names them as the job does. Prints one JSON line: what it planted.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from undying.protocol.verify_wire import VERIFY_CODEC, VerifyResult


def _zeroed(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeroed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_zeroed(v) for v in obj]
    return obj


def _read_state(path: Path) -> Any:
    raw = path.read_bytes()
    start = raw.find(b"PK\x03\x04")  # a torch.save zip, after any header
    return torch.load(io.BytesIO(raw[max(start, 0):]), weights_only=True)


def forge(folder: Path, count: int, seconds: float) -> dict[str, list[str]]:
    planted: dict[str, list[str]] = {"states": [], "verdicts": []}
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while len(seen) < count and time.monotonic() < deadline:
        for pre in sorted(folder.glob("pre-*.pt")) if folder.is_dir() else []:
            if pre.name in seen or len(seen) >= count:
                continue
            try:
                state = _zeroed(_read_state(pre))
            except Exception:  # still being written: the next look
                continue
            seen.add(pre.name)
            _, round_, step = pre.stem.split("-")
            tmp = folder / f".forged-{os.getpid()}.tmp"
            torch.save(state, tmp)
            os.replace(tmp, pre)
            planted["states"].append(pre.name)
            verdict = VerifyResult(round_, int(step), 0, 1, False, [0], 0.001, time.time())
            # The verdict under the step's own name races the verifier's (whose file replaces it);
            # one for a step no verifier answers waits for rank 0's next look, however late.
            for res in (folder / f"res-{round_}-{step}.json", folder / f"res-{round_}-{int(step) + 10**6}.json"):
                tmp.write_bytes(VERIFY_CODEC.encode(verdict))
                os.replace(tmp, res)
                planted["verdicts"].append(res.name)
        time.sleep(0.005)
    return planted


if __name__ == "__main__":
    print(json.dumps(forge(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))), flush=True)
