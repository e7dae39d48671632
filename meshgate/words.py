"""Counted nouns in messages: ``counted(1, "slot")`` is "1 slot", ``counted(4, "slot")`` "4 slots"."""

from __future__ import annotations


def counted(number: int, noun: str, plural: str = "") -> str:
    """``number`` and ``noun``, the noun plural (``plural``, default noun + "s") unless it is 1."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
