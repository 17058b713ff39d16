"""The trace switch's value: which markers are on, and who turned them on or off.

Two flags, because the markers switch in two groups: ``step`` turns the step,
checkpoint, forward and data-loading markers on and off together (they are
cheap, once or a few times per step), ``comm`` turns the collective markers
alone (one per bucket per step, more records). Comm markers are read against
the step they belong to, so comm on requires step on; the switch refuses any
state that breaks that rule instead of silently fixing it, except ``trace
off`` from the CLI, which says that it turned comm off too. It is part of the
contract: the manager sets it, the agents pass it on, a switch file (a mounted
ConfigMap) spells it in the same JSON; reading and watching that file is
``undying.trace.switch``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from undying.errors import UsageError

__all__ = ["TraceSwitch", "TraceSwitchError", "SWITCH_EXAMPLE"]

# What a valid switch file looks like; quoted in every parse error.
SWITCH_EXAMPLE = '{"step": "on", "comm": "off"}'

# Keys that must carry the same value as "step": they name the markers that
# "step" switches, and a user may write them out to be explicit.
_STEP_GROUP_KEYS = ("ckpt", "fp", "data")
# Informational keys written by ``to_dict``; accepted and ignored on parse so a
# saved switch reads back (the parse call's ``by``/``t`` describe the new change).
_INFO_KEYS = ("by", "t")
_ALLOWED_KEYS = ("step", "comm", *_STEP_GROUP_KEYS, *_INFO_KEYS)

_COMM_NEEDS_STEP = (
    "comm markers need the step markers: turn step on too "
    '({"step": "on", "comm": "on"}) or leave comm off'
)


class TraceSwitchError(UsageError):
    """A trace switch setting that is malformed or breaks the comm-needs-step rule."""


@dataclass(frozen=True)
class TraceSwitch:
    """Which markers are on: ``step`` (step, ckpt, fp, data) and ``comm`` (collectives).

    ``by`` and ``t`` record the last change (who, wall time) so that ``status``
    can say why tracing is on; they take no part in ``same_markers``.
    """

    step: bool = False
    comm: bool = False
    by: str = ""
    t: float = field(default=0.0)

    def __post_init__(self) -> None:
        for name in ("step", "comm"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TraceSwitchError(
                    f"trace switch {name!r} must be a bool, got {type(value).__name__} {value!r}"
                )
        if self.comm and not self.step:
            raise TraceSwitchError(_COMM_NEEDS_STEP)

    @classmethod
    def parse(cls, mapping: object, *, by: str, t: float) -> TraceSwitch:
        """A switch from a JSON object like ``{"step": "on", "comm": "off"}``.

        Values are "on"/"off" (any case) or true/false; a missing key means off.
        "ckpt", "fp" and "data" may be given only with the same value as
        "step", because they switch together with it.
        """
        if not isinstance(mapping, Mapping):
            raise TraceSwitchError(
                f"a trace switch must be a JSON object like {SWITCH_EXAMPLE}, "
                f"got {type(mapping).__name__} {_short(mapping)}"
            )
        for key in mapping:
            if key not in _ALLOWED_KEYS:
                raise TraceSwitchError(
                    f"unknown trace switch key {_short(key)}: the keys are 'step' "
                    f"(step, ckpt, fp and data markers) and 'comm' (collective markers), "
                    f"e.g. {SWITCH_EXAMPLE}"
                )
        step = _flag(mapping, "step")
        comm = _flag(mapping, "comm")
        for key in _STEP_GROUP_KEYS:
            if key in mapping and _flag(mapping, key) != step:
                raise TraceSwitchError(
                    f"trace switch key {key!r} is {_word(_flag(mapping, key))} but 'step' is "
                    f"{_word(step)}: the {key} markers switch together with the step "
                    f"markers; set 'step' (and drop {key!r})"
                )
        return cls(step=step, comm=comm, by=by, t=t)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the API and ``status`` show; ``parse`` reads it back."""
        return {"step": self.step, "comm": self.comm, "by": self.by, "t": self.t}

    def same_markers(self, other: TraceSwitch) -> bool:
        """Whether both turn the same markers on, whoever set them and when."""
        return self.step == other.step and self.comm == other.comm

    def describe(self) -> str:
        """A short human form: ``step on, comm off``."""
        return f"step {_word(self.step)}, comm {_word(self.comm)}"

    def changed(self, *, on: bool, comm_only: bool, by: str, t: float) -> tuple[TraceSwitch, str]:
        """The switch after a CLI ``trace on|off [--comm]``, and a one-line message.

        ``trace on`` turns the step markers on (comm unchanged); ``trace on
        --comm`` turns comm on, and step with it; ``trace off --comm`` turns
        comm off only; ``trace off`` turns step off and, since comm needs it,
        comm too, which the message says.
        """
        step, comm = self.step, self.comm
        if on and comm_only:
            if comm:
                msg = "comm markers already on"
            elif step:
                msg = "comm markers on"
            else:
                msg = ("comm markers on, and step markers (step, ckpt, fp, data) on too: comm "
                       "markers need them")
            step = comm = True
        elif on:
            msg = (
                "step markers (step, ckpt, fp, data) already on"
                if step
                else "step markers (step, ckpt, fp, data) on"
            )
            msg += f"; comm markers stay {_word(comm)}"
            step = True
        elif comm_only:
            msg = "comm markers off" if comm else "comm markers already off"
            msg += f"; step markers stay {_word(step)}"
            comm = False
        else:
            if step:
                msg = "step markers (step, ckpt, fp, data) off"
                if comm:
                    msg += "; comm markers turned off too: they need the step markers"
            else:
                msg = "trace markers already off"
            step = comm = False
        return TraceSwitch(step=step, comm=comm, by=by, t=t), msg



def _flag(mapping: Mapping[Any, Any], key: str) -> bool:
    """The bool a switch value means; a missing key is off."""
    if key not in mapping:
        return False
    value = mapping[key]
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("on", "off"):
        return value.strip().lower() == "on"
    raise TraceSwitchError(
        f'trace switch key {key!r} has value {_short(value)}: use "on" or "off" '
        f"(or true/false), e.g. {SWITCH_EXAMPLE}"
    )


def _word(flag: bool) -> str:
    return "on" if flag else "off"


def _short(value: object) -> str:
    """A value for an error message, cut short so a huge input stays readable."""
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
