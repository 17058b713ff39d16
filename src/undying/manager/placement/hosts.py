"""A host's placement state: ``ok``, ``drained`` by an operator, or ``quarantined`` by a fault
policy.

One state per host, shared by the two ways a host is taken out: an operator
drains it (``undying drain HOST``, before maintenance) and a fault policy
quarantines it (a rank found at fault twice there: ``quarantine``, with the
reason). Either way the host gets no new ranks (a standby on it is not
promoted, a migration does not go to it) until an operator clears it
(``undying undrain HOST``, the one clear surface for both), or, for a
quarantined host only, until it requalifies (``verified``): with
``--verify-every``, REQUALIFY_PASSES steps of its ranks replayed and matched
bit for bit in a row (a mismatch there starts the count again). A drained
host never requalifies: the operator took it out and puts it back, and a
drain given while the host is quarantined (or a quarantine of a drained
host) is kept under the quarantine: when the host requalifies it is drained
still, not back in use behind the operator's back. Without
``--verify-every`` nothing is verified, so only the operator clears it. The record is a
plain value kept in the job's log (``to_log`` / ``from_log``), so a
restarted manager keeps it. Pure: no I/O, no clock (times are given).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from undying.errors import UsageError

__all__ = ["HostState", "HostMark", "HostBook", "LOG_KEY", "check_host", "check_job_host",
           "REQUALIFY_PASSES"]

LOG_KEY = "hosts"  # the job fact the book is kept under in the event log
# A quarantined host is cleared after this many verified steps of its ranks in a row (each a replay
# that matched bit for bit): three, so one lucky step does not clear a host found at fault twice,
# and a job verifying every K steps with R ranks on the host gets it back within about 3*K*world/R
# steps.
REQUALIFY_PASSES = 3
# a hostname, an IPv4 or a bracketed or bare IPv6
_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]{1,255}$")


class HostState(enum.StrEnum):
    OK = "ok"
    DRAINED = "drained"  # by an operator: no new ranks until undrained
    QUARANTINED = "quarantined"  # by a fault policy (with its reason): no new ranks until cleared


@dataclass(frozen=True)
class HostMark:
    """Why a host is out: its state, who put it there, the reason, and when."""

    host: str
    state: HostState
    reason: str
    by: str
    t: float
    # quarantined: verified steps of its ranks in a row since it was quarantined or last mismatched
    passes: int = 0
    steps: tuple[int, ...] = ()  # which steps those were
    # quarantined: the operator's drain kept under it, the state once it requalifies
    drained: HostMark | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host": self.host, "state": self.state.value, "reason": self.reason,
                               "by": self.by, "t": self.t}
        if self.state is HostState.QUARANTINED:
            out |= {"passes": self.passes, "needed": REQUALIFY_PASSES, "steps": list(self.steps)}
            if self.drained is not None:
                out["drained"] = self.drained.to_dict()
        return out

    @classmethod
    def from_dict(cls, item: Any) -> HostMark:
        """A mark as ``to_dict`` wrote it; KeyError, TypeError or ValueError when it is not one."""
        under = item.get("drained")
        return cls(str(item["host"]), HostState(item["state"]), str(item.get("reason", "")),
                   str(item.get("by", "")), float(item.get("t", 0.0)), int(item.get("passes", 0)),
                   tuple(int(s) for s in item.get("steps", ())),
                   cls.from_dict(under)
                   if isinstance(under, dict) and under.get("state") == "drained" else None)


def check_host(host: object) -> str:
    """A host name as given on the command line or in a request, checked; the error names it."""
    if not isinstance(host, str) or not _HOST.match(host):
        raise UsageError(f"host {host!r} is not a host name or address (letters, digits, '.', '-', "
                         "':', at most 255 characters); give it as `undying status` lists it "
                         "under nodes")
    return host


def check_job_host(host: object, known: Iterable[str], *, others_may_join: bool) -> str:
    """``host`` checked, and one the job knows (``known``: its nodes', its standbys', those already
    out).

    A host the job does not know is a name under which nothing can ever be
    drained when no other host can join (one node, the manager in its
    launcher, which calls its host ``localhost``): refused, naming the hosts
    it knows. A job of several nodes takes it: an agent from that host may
    still come (a drained host's new agent is refused).
    """
    check_host(host)
    names = sorted({h for h in known if h})
    if not others_may_join and host not in names:
        raise UsageError(f"host {host} is not a host of this job, which runs on "
                         f"{', '.join(names) or 'no host yet'} "
                         "(one node, whose manager runs in its launcher: no other host can join "
                         "it); give a host as `undying status` lists it under nodes")
    return str(host)


class HostBook:
    """Every host that is not ``ok``; a host absent from it is ``ok``."""

    def __init__(self) -> None:
        self._marks: dict[str, HostMark] = {}

    def state(self, host: str) -> HostState:
        mark = self._marks.get(host)
        return mark.state if mark is not None else HostState.OK

    def blocked(self, host: str) -> bool:
        """Whether ``host`` may get no new ranks."""
        return host in self._marks

    def blocked_hosts(self) -> set[str]:
        return set(self._marks)

    def refusal(self, host: str) -> str:
        """Why ``host`` gets no new ranks, as every refusal says it ("" when it may get them)."""
        if host not in self._marks:
            return ""
        return (f"host {host} is {self.state(host).value}: it gets no new ranks; "
                f"`undying undrain {host}` first")

    def drain(self, host: str, *, by: str, reason: str, t: float) -> HostMark:
        """An operator takes the host out. A quarantined host stays quarantined (its reason is
        kept), with the drain kept under it: the host is drained still once it requalifies."""
        current = self._marks.get(check_host(host))
        mark = HostMark(host, HostState.DRAINED, reason or "drained by an operator", by, t)
        if current is not None and current.state is HostState.QUARANTINED:
            self._marks[host] = current = replace(current, drained=mark)
            return current
        self._marks[host] = mark
        return mark

    def quarantine(self, host: str, *, reason: str, by: str, t: float) -> HostMark:
        """A fault policy takes the host out, with its reason (a drained host becomes quarantined,
        its drain kept under the quarantine)."""
        if not reason.strip():
            raise UsageError(
                f"quarantining host {host!r} needs a reason (what was found at fault there)")
        current = self._marks.get(check_host(host))
        under = current if current is not None and current.state is HostState.DRAINED else (
            current.drained if current is not None else None)
        mark = HostMark(host, HostState.QUARANTINED, reason.strip()[:500], by, t, drained=under)
        self._marks[host] = mark
        return mark

    def verified(self, host: str, *, passed: bool, step: int) -> HostMark | None:
        """A verified step of a rank on ``host``: counted when the host is quarantined, else None.

        The mark after counting: still quarantined with ``passes`` one more (or
        0 after a mismatch), or, at the REQUALIFY_PASSES-th pass in a row, the
        quarantine cleared and the mark returned with state ``ok`` (it requalified;
        the host is then ``ok``, or drained still when a drain was kept under the
        quarantine). A drained or ok host is not counted (None).
        """
        mark = self._marks.get(host)
        if mark is None or mark.state is not HostState.QUARANTINED:
            return None
        if not passed:
            mark = replace(mark, passes=0, steps=())
        else:
            steps = (*mark.steps, step)[-REQUALIFY_PASSES:]
            mark = replace(mark, passes=mark.passes + 1, steps=steps)
        if mark.passes >= REQUALIFY_PASSES:
            if mark.drained is not None:
                self._marks[host] = mark.drained
            else:
                del self._marks[host]
            return replace(mark, state=HostState.OK)
        self._marks[host] = mark
        return mark

    def clear(self, host: str) -> HostMark | None:
        """An operator puts the host back (drained or quarantined); the mark it had, or None (it was
        ok)."""
        return self._marks.pop(check_host(host), None)

    def view(self) -> list[dict[str, Any]]:
        """The hosts that are out, for `undying status` and the page: oldest first."""
        return [m.to_dict() for m in sorted(self._marks.values(), key=lambda m: m.t)]

    def to_log(self) -> list[dict[str, Any]]:
        return self.view()

    @classmethod
    def from_log(cls, logged: object) -> HostBook:
        """The book a manager wrote (nothing, or a list of marks); anything unreadable is left
        out."""
        book = cls()
        if not isinstance(logged, list):
            return book
        for item in logged:
            try:
                mark = HostMark.from_dict(item)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if mark.state is not HostState.OK:
                book._marks[mark.host] = mark
        return book
