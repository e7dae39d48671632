"""Slurm's node lists, for a job whose nodes Slurm chose (``meshgate job submit
--nodes-from-slurm``, inside an sbatch or salloc allocation).

``SLURM_JOB_NODELIST`` is a compressed hostlist ("node[01-03,07]", "rack[1-2]-n[01-02]");
``expand_hostlist`` expands it in Slurm's order, as ``scontrol show hostnames`` does
(tests/test_slurm.py checks that the two agree where Slurm is installed). It is our own
so that submitting needs no Slurm client on the submitting host and behaves the same
everywhere. Slurm's node name is the meshgate node id: an agent's node_id defaults to its
host's name, which is what a Slurm NodeName is by convention (set ``node_id`` where they
differ). Pure: no Slurm, no sockets.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Mapping

NODELIST_ENV = "SLURM_JOB_NODELIST"
# No allocation is larger; a longer expansion is a mistake, refused before it is built.
MAX_HOSTS = 1 << 16
_NUMBER = re.compile(r"[0-9]+")


class HostlistError(ValueError):
    """A node list that is not a Slurm hostlist; the message names the part."""


def expand_hostlist(text: str) -> list[str]:
    """``text``'s host names, in order: items split at commas outside brackets, each
    bracket a list of numbers and ranges ("01-03,07", zero-padded to the width of the
    range's start) and each item the product of its brackets, left to right. Duplicates
    are kept (a job spec refuses them, naming them)."""
    hosts: list[str] = []
    for item in _items(text):
        pieces = _pieces(item)
        if len(hosts) + math.prod(len(p) for p in pieces) > MAX_HOSTS:
            raise HostlistError(f"{_shown(text)} names more than {MAX_HOSTS} hosts")
        hosts += ["".join(parts) for parts in itertools.product(*pieces)]
    return hosts


def nodes_from_env(environ: Mapping[str, str]) -> list[str]:
    """The nodes of the Slurm allocation this process runs in (``SLURM_JOB_NODELIST``)."""
    text = environ.get(NODELIST_ENV, "")
    if not text:
        raise HostlistError(
            f"{NODELIST_ENV} is not set: --nodes-from-slurm runs inside a Slurm allocation (sbatch, salloc); "
            "elsewhere name the nodes with --node-list"
        )
    hosts = expand_hostlist(text)
    if not hosts:
        raise HostlistError(f"{NODELIST_ENV}={_shown(text)} names no node")
    return hosts


def _items(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise HostlistError(f"{_shown(text)}: brackets do not pair (at character {position})")
        if char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    if depth:
        raise HostlistError(f"{_shown(text)}: '[' without ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _pieces(item: str) -> list[list[str]]:
    """``item`` as a product: literal text and, for each bracket, its numbers."""
    pieces = []
    for position, part in enumerate(re.split(r"[\[\]]", item)):
        pieces.append(_numbers(part, item) if position % 2 else [part])
    return pieces


def _numbers(body: str, item: str) -> list[str]:
    numbers: list[str] = []
    for span in body.split(","):
        low, dash, high = span.partition("-")
        if not _NUMBER.fullmatch(low) or (dash and not _NUMBER.fullmatch(high)):
            raise HostlistError(f"{_shown(item)}: {_shown(span)} is not a number or a range like 01-03")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise HostlistError(f"{_shown(item)}: range {_shown(span)} runs backwards")
        if len(numbers) + last - first + 1 > MAX_HOSTS:
            raise HostlistError(f"{_shown(item)} names more than {MAX_HOSTS} hosts")
        numbers += [str(n).zfill(len(low)) for n in range(first, last + 1)]
    return numbers


def _shown(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")
