"""Pages bounded in bytes as well as in rows: a list answer stops before a byte budget
well under gRPC's default 4 MiB receive limit, so no client refuses a page (and the
coordinator logs no traceback for one it could not send), whatever the rows weigh: an
admin's page of jobs carries each job's command and env, up to 128 KiB a row. Pure."""

from __future__ import annotations

from typing import Any, Iterable, Optional, TypeVar

from google.protobuf.message import Message

# What one list answer may weigh, serialized: a quarter of gRPC's default receive limit
# (4 MiB), so a page, its envelope and its token always arrive.
MAX_PAGE_BYTES = 1 << 20
# A repeated message field's tag and length prefix (at most 1 + 5 bytes for a row < 4 GiB).
_ROW_FRAMING = 6

# What one job's answer may spend on its nodes: the Status's NodeStatus rows (a few hundred
# bytes each: some thousands of nodes), and JobInfo's node names. With the spec's command
# and env (at most 2 x 64 KiB) a job's answer stays under 1.5 MiB, whatever its size.
MAX_STATUS_NODES_BYTES = 1 << 20
MAX_NODE_NAMES_BYTES = 256 << 10

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


def fitting(sizes: Iterable[int], budget: int) -> int:
    """How many of the leading rows of a repeated field (``sizes``: each row's serialized
    bytes) fit in ``budget``, with their framing."""
    used = count = 0
    for size in sizes:
        used += size + _ROW_FRAMING
        if used > budget:
            break
        count += 1
    return count


def bound_repeated(*fields: Any, budget: int) -> int:
    """Drop the last rows of ``fields`` (repeated message or string fields, sharing
    ``budget`` in order: once one is cut, the later ones are emptied) past ``budget``;
    how many rows were dropped in all."""
    dropped = 0
    for field in fields:
        sizes = [len(row.encode()) if isinstance(row, str) else row.ByteSize() for row in field]
        kept = fitting(sizes, budget) if not dropped else 0
        budget -= sum(sizes[:kept]) + _ROW_FRAMING * kept
        dropped += len(field) - kept
        del field[kept:]
    return dropped


__all__ = [
    "MAX_NODE_NAMES_BYTES",
    "MAX_PAGE_BYTES",
    "MAX_STATUS_NODES_BYTES",
    "bound_repeated",
    "bounded_page",
    "fitting",
]
