"""Pages bounded in bytes as well as in rows: a list answer stops before a byte budget
well under gRPC's default 4 MiB receive limit, so no client refuses a page (and the
coordinator logs no traceback for one it could not send), whatever the rows weigh: an
admin's page of jobs carries each job's command and env, up to 128 KiB a row. Pure."""

from __future__ import annotations

from typing import Iterable, Optional, TypeVar

from google.protobuf.message import Message

# What one list answer may weigh, serialized: a quarter of gRPC's default receive limit
# (4 MiB), so a page, its envelope and its token always arrive.
MAX_PAGE_BYTES = 1 << 20
# A repeated message field's tag and length prefix (at most 1 + 5 bytes for a row < 4 GiB).
_ROW_FRAMING = 6

Position = TypeVar("Position")
Row = TypeVar("Row", bound=Message)


def bounded_page(
    rows: Iterable[tuple[Position, Row]], page_size: int, budget: int = MAX_PAGE_BYTES
) -> tuple[list[Row], Optional[Position]]:
    """The first rows of ``rows`` (each with where it sits) until ``page_size`` rows or
    until the next would take the page past ``budget`` serialized bytes; and where the
    first row left out sits (None: none was). A page holds at least one row, so a reader
    always gets on: every row is bounded far below the budget by its own checks."""
    page: list[Row] = []
    used = 0
    for position, row in rows:
        cost = row.ByteSize() + _ROW_FRAMING
        if len(page) == page_size or (page and used + cost > budget):
            return page, position
        page.append(row)
        used += cost
    return page, None


__all__ = ["MAX_PAGE_BYTES", "bounded_page"]
