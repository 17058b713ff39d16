"""The trace switch: which markers are on, and who turned them on or off.

Two flags, because the markers switch in two groups (DESIGN.md §5): ``step``
turns the step, checkpoint, forward and data-loading markers on and off
together (they are cheap, once or a few times per step), ``comm`` turns the
collective markers alone (one per bucket per step, more records). Comm markers
are read against the step they belong to, so comm on requires step on; the
switch refuses any state that breaks that rule instead of silently fixing it,
except ``trace off`` from the CLI, which says that it turned comm off too.

The switch changes while the job runs: from the API, the CLI, or a watched
JSON file such as a mounted Kubernetes ConfigMap (``SwitchFileWatcher``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undying.errors import UsageError

__all__ = [
    "TraceSwitchError",
    "TraceSwitch",
    "SWITCH_EXAMPLE",
    "read_switch_file",
    "SwitchFileWatcher",
]

log = logging.getLogger("undying.trace")

# What a valid switch file looks like; quoted in every parse error.
SWITCH_EXAMPLE = '{"step": "on", "comm": "off"}'

# Keys that must carry the same value as "step": they name the markers that
# "step" switches, and a user may write them out to be explicit.
_STEP_GROUP_KEYS = ("ckpt", "fp", "data")
# Informational keys written by ``to_dict``; accepted and ignored on parse so a
# saved switch reads back (the parse call's ``by``/``t`` describe the new change).
_INFO_KEYS = ("by", "t")
_ALLOWED_KEYS = ("step", "comm", *_STEP_GROUP_KEYS, *_INFO_KEYS)
# A switch file is a few dozen bytes; anything far larger is not one.
_MAX_FILE_BYTES = 64 * 1024

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
                msg = "comm markers on, and step markers (step, ckpt, fp, data) on too: comm markers need them"
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


def read_switch_file(path: str | os.PathLike[str], *, t: float | None = None) -> TraceSwitch:
    """The switch a JSON file sets (``by`` is ``"file <path>"``).

    Raises ``TraceSwitchError`` naming the file when it cannot be read, is not
    JSON, or holds a bad setting.
    """
    switch, _ = _read(Path(path), time.time() if t is None else t)
    return switch


def _read(path: Path, t: float) -> tuple[TraceSwitch, bytes]:
    """The switch and the raw content it was parsed from (the watcher compares content)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise TraceSwitchError(
            f"trace switch file {path} does not exist; write {SWITCH_EXAMPLE} there"
        ) from e
    except OSError as e:
        raise TraceSwitchError(f"cannot read trace switch file {path}: {e.strerror or e}") from e
    return _parse_bytes(path, data, t), data


def _parse_bytes(path: Path, data: bytes, t: float) -> TraceSwitch:
    if len(data) > _MAX_FILE_BYTES:
        raise TraceSwitchError(
            f"trace switch file {path} is larger than {_MAX_FILE_BYTES} bytes: "
            f"it should hold one small JSON object like {SWITCH_EXAMPLE}"
        )
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TraceSwitchError(f"trace switch file {path} is not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise TraceSwitchError(
            f"trace switch file {path} is not valid JSON ({e.msg} at line {e.lineno} "
            f"column {e.colno}); write an object like {SWITCH_EXAMPLE}"
        ) from e
    try:
        return TraceSwitch.parse(obj, by=f"file {path}", t=t)
    except TraceSwitchError as e:
        raise TraceSwitchError(f"trace switch file {path}: {e}") from e


class SwitchFileWatcher:
    """Polls a JSON switch file and reports each new setting, like a ConfigMap mount.

    Kubernetes updates a mounted ConfigMap by swapping a symlink to a new
    directory, so the file's own mtime may not change; the watcher compares
    the bytes read. A change is reported only when the content parses to
    markers different from the last good setting, so rewriting the same
    setting, or a CLI change made meanwhile, is not overridden by an
    unchanged file. Bad content is reported once per distinct content and the
    last good setting stays; a missing file is reported once until it returns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[TraceSwitch], None],
        on_error: Callable[[str], None],
        interval_s: float = 0.2,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self._on_change = on_change
        self._on_error = on_error
        self._content: bytes | None = None  # the last content read (good or bad)
        self._last_good: TraceSwitch | None = None
        self._reported: str | None = None  # the last error reported, not repeated

    @property
    def last_good(self) -> TraceSwitch | None:
        """The last setting read from the file, or None if none was good yet."""
        return self._last_good

    def poll_once(self) -> TraceSwitch | None:
        """Read the file once; the new switch if its markers changed, else None."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(_MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            # Forget the content so the file is read afresh when it returns.
            self._content = None
            self._error(
                f"trace switch file {self.path} is missing; keeping the last setting"
                + (f" ({self._last_good.describe()})" if self._last_good else "")
            )
            return None
        except OSError as e:
            self._content = None
            self._error(f"cannot read trace switch file {self.path}: {e.strerror or e}")
            return None
        if data == self._content:
            return None
        self._content = data
        try:
            switch = _parse_bytes(self.path, data, time.time())
        except TraceSwitchError as e:
            # Content is parsed only when it changes, so each distinct bad
            # content is reported exactly once, even two with the same message.
            kept = f" ({self._last_good.describe()})" if self._last_good else ""
            self._reported = f"{e}; keeping the last setting{kept}"
            self._on_error(self._reported)
            return None
        self._reported = None
        if self._last_good is not None and switch.same_markers(self._last_good):
            return None
        self._last_good = switch
        self._on_change(switch)
        return switch

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled; a failing callback is logged, not fatal."""
        while True:
            try:
                self.poll_once()
            except Exception:
                log.exception("trace switch watcher for %s: a callback failed", self.path)
            await asyncio.sleep(self.interval_s)

    def _error(self, message: str) -> None:
        """Report a missing or unreadable file once, not on every poll."""
        if message == self._reported:
            return
        self._reported = message
        self._on_error(message)


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
