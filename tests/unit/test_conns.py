"""The log filter that keeps a flood of bad requests from growing the manager's log (issue 14, finding 3)."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest

from undying.config import ConnectionLimits
from undying.errors import UsageError
from undying.manager.conns import QuietLog, read_line


def _logger(name: str, window_s: float = 60.0) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    logger = logging.getLogger(f"test.conns.{name}")
    logger.handlers[:] = [logging.StreamHandler(out)]
    logger.propagate = False
    logger.filters[:] = [QuietLog(burst=3, window_s=window_s)]
    return logger, out


def test_a_flood_of_one_kind_is_a_few_lines_without_tracebacks() -> None:
    logger, out = _logger("flood")
    for i in range(1000):
        try:
            raise ValueError(f"bad request {i} with 100% junk")
        except ValueError:
            logger.exception("Error handling request from %s", "127.0.0.1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "Traceback" not in out.getvalue()
    assert "ValueError: bad request 0 with 100% junk" in lines[0]
    assert "held back" in lines[-1]


def test_after_the_window_the_count_of_held_back_lines_is_told() -> None:
    logger, out = _logger("window", window_s=0.0)
    logger.warning("refused %s", "a")  # the first of its window: then 2 more pass, 8 are held back
    filt = logger.filters[0]
    assert isinstance(filt, QuietLog)
    filt.window_s = 3600.0
    for _ in range(10):
        logger.warning("refused %s", "b")
    filt.window_s = 0.0
    logger.warning("refused %s", "c")
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("refused c") and "8 more like it held back" in last, last


def test_other_kinds_are_not_held_back_by_a_flood() -> None:
    logger, out = _logger("kinds")
    for _ in range(100):
        logger.warning("flood")
    logger.warning("something else")
    assert out.getvalue().splitlines()[-1] == "something else"


@pytest.mark.parametrize("limits", [
    ConnectionLimits(http_header_timeout=0), ConnectionLimits(http_header_timeout=float("nan")),
    ConnectionLimits(http_idle_timeout=float("inf")), ConnectionLimits(http_idle_timeout=61), ConnectionLimits(max_connections=-1),
])
def test_connection_limits_are_checked(limits: ConnectionLimits) -> None:
    with pytest.raises(UsageError):
        limits.validate()


def test_the_default_cap_leaves_most_descriptors_to_the_job() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = ConnectionLimits().cap
    assert 16 <= cap <= 1024 and (soft == resource.RLIM_INFINITY or cap <= max(16, soft // 4))


def test_read_line_gathers_a_long_line_up_to_its_own_bound() -> None:
    """The agents' port reads with a 64 KiB reader limit; a joined agent's longer line is gathered, an
    unbounded one refused, and the end of the stream answers as readline does."""

    async def scenario() -> None:
        reader = asyncio.StreamReader(limit=64 * 1024)
        line = b"r" * (1024 * 1024) + b"\n"
        reader.feed_data(line + b"short\n" + b"partial")
        reader.feed_eof()
        assert await read_line(reader, 16 * 1024 * 1024) == line
        assert await read_line(reader, 16 * 1024 * 1024) == b"short\n"
        assert await read_line(reader, 16 * 1024 * 1024) == b"partial"
        assert await read_line(reader, 16 * 1024 * 1024) == b""
        bounded = asyncio.StreamReader(limit=64 * 1024)
        bounded.feed_data(b"x" * (300 * 1024) + b"\n")
        with pytest.raises(ValueError, match="longer than"):
            await read_line(bounded, 100 * 1024)

    asyncio.run(scenario())
