"""What a request to the manager's HTTP API carries: its JSON body, read and held to what a request
may hold, and each endpoint's fields checked whole before anything is done. A malformed body is a
400 that names the field (never a 500)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

__all__ = ["INJECT_EXAMPLE", "MAX_BODY", "Malformed", "error", "inject_fields", "json_response",
           "parse_json", "read_body", "series_query", "short", "who"]

INJECT_EXAMPLE = '{"kind": "crash", "rank": 0}'
_INJECT_FIELDS = ("kind", "rank", "at_step", "phase", "how", "factor")
# A request body: every endpoint's fits in a few hundred bytes. aiohttp answers 413 past this.
MAX_BODY = 64 * 1024
# JSON nesting and integer digits past these are no request of ours (and would cost a deep recursion
# or a quadratic int parse): 400 before they are parsed.
_MAX_DEPTH = 16
_MAX_DIGITS = 30
# Ranks and steps are counted, never negative; a step past this is no step a job reaches.
_MAX_STEP = 2**53
_MAX_RANK = 2**20
_BODY_WAIT_S = 10.0
# The page's charts: points per series it may ask for (the default draws one a few pixels wide).
_POINTS_DEFAULT, _POINTS_MAX = 400, 2000


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers,
                             dumps=lambda d: json.dumps(d, default=str))


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_response({"error": message}, status=status, headers=headers)


def series_query(query: Mapping[str, str]) -> tuple[int | None, int | None, int]:
    """``from``, ``to`` and ``points`` of a series request, each checked;
    ``Malformed`` names the bad one."""

    def whole(name: str, low: int, high: int) -> int | None:
        raw = query.get(name)
        if raw is None or raw == "":
            return None
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 16 or not low <= int(raw) <= high:
            raise Malformed(f"?{name}= must be a whole number from {low} to {high}, "
                            f"got {short(raw)}; e.g. /api/series?from=100&to=500&points=400")
        return int(raw)

    first, last = whole("from", 0, _MAX_STEP), whole("to", 0, _MAX_STEP)
    if first is not None and last is not None and first > last:
        raise Malformed(f"?from={first} is after ?to={last}; ask for a range of steps from the "
                        "first to the last")
    points = whole("points", 10, _POINTS_MAX)
    return first, last, _POINTS_DEFAULT if points is None else points


async def read_body(request: web.Request, example: str) -> dict[str, Any] | web.Response:
    """The request's JSON object, or the 400 that says what is wrong with it (never a 500)."""
    try:
        raw = await asyncio.wait_for(request.read(), _BODY_WAIT_S)
    except asyncio.TimeoutError:
        return error(408, f"the request body did not arrive within {_BODY_WAIT_S:.0f} s")
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"the body is over {MAX_BODY} bytes; a request is a small JSON object "
                          f"like {example}")
    try:
        body = parse_json(raw)
    except ValueError as e:
        return error(400, f"the body must be a JSON object like {example}: {e}")
    if not isinstance(body, dict):
        return error(400, f"the body must be a JSON object like {example}, "
                          f"got {type(body).__name__}")
    return body


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, held to what a request may hold; ``ValueError`` says what is wrong.

    ``json.loads`` alone turns a deep nesting into a RecursionError, 5,000
    digits into Python's int-conversion error and ``NaN`` into a float: each
    would have been a 500 or a number no check expects.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8") from None
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > _MAX_DEPTH:
                raise ValueError(f"it nests deeper than {_MAX_DEPTH} levels")
        elif ch in "]}":
            depth -= 1

    def whole(digits: str) -> int:
        if len(digits.lstrip("-")) > _MAX_DIGITS:
            raise ValueError(f"a number has more than {_MAX_DIGITS} digits")
        return int(digits)

    def real(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise ValueError(f"the number {digits[:20]} is out of range")
        return value

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        return json.loads(text, parse_int=whole, parse_float=real, parse_constant=constant)
    except RecursionError:
        raise ValueError(f"it nests deeper than {_MAX_DEPTH} levels") from None


def short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class Malformed(Exception):
    """A request body field that is missing or of the wrong type; the message names it."""


def inject_fields(
    body: dict[str, Any],
) -> tuple[str, int, int | None, str | None, str | None, float | None]:
    """The inject request's fields, each checked on its own; ``Malformed`` names the first bad one.

    Strict on purpose: ``int()`` would quietly turn a rank of 1.7 into 1 and
    fault a rank nobody asked for, and a misspelt field would be dropped.
    """
    unknown = sorted(k for k in body if k not in _INJECT_FIELDS)
    if unknown:
        raise Malformed(f"unknown field {short(unknown[0])} in the inject body; the fields are "
                         f"{', '.join(_INJECT_FIELDS)}, e.g. {INJECT_EXAMPLE}")

    def whole(name: str, low: int, high: int) -> int | None:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise Malformed(f'"{name}" must be a whole number, got {short(value)}; '
                            f"e.g. {INJECT_EXAMPLE}")
        if value is not None and not low <= value <= high:
            raise Malformed(f'"{name}" must be between {low} and {high}, got {short(value)}; '
                            f"e.g. {INJECT_EXAMPLE}")
        return value

    def text(name: str) -> str | None:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise Malformed(f'"{name}" must be a string, got {short(value)}; e.g. {INJECT_EXAMPLE}')
        return value

    def number(name: str) -> float | None:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise Malformed(f'"{name}" must be a number, got {short(value)}; '
                            "e.g. 1.2 for steps 20% slower")
        return None if value is None else float(value)

    rank = whole("rank", 0, _MAX_RANK)
    if rank is None:
        raise Malformed(f'inject needs a "rank" (a whole number), e.g. {INJECT_EXAMPLE}')
    kind = text("kind")
    return (kind if kind is not None else "crash", rank, whole("at_step", 1, _MAX_STEP),
            text("phase"), text("how"), number("factor"))


def who(request: web.Request, body: dict[str, Any]) -> str:
    """Who changed the switch, as the status shows it: the caller's own word,
    else the API and its peer."""
    said = body.get("by")
    if isinstance(said, str) and said.strip():
        return said.strip()[:80]
    return f"api {request.remote or ''}".strip()
