"""Lines from a child's pipe: an over-long one is dropped and reported, and reading goes on."""

from __future__ import annotations

import asyncio

from mpsd.daemon.supervise.child_output import output_lines


def test_a_line_over_the_limit_is_dropped_and_the_next_ones_still_come() -> None:
    async def main() -> tuple[list[str], int]:
        stream = asyncio.StreamReader(limit=16)
        stream.feed_data(b"short\n" + b"x" * 100 + b"\nafter\xff\n\nlast")
        stream.feed_eof()
        dropped = [0]

        def too_long() -> None:
            dropped[0] += 1

        return [line async for line in output_lines(stream, too_long)], dropped[0]

    lines, dropped = asyncio.run(main())
    assert lines == ["short", "after\ufffd", "", "last"]
    assert dropped == 1
