"""The one refusal of a value the user asked for that is not among the known ones.

``opalctl grid --arm/--seed`` (``grid.plan``) and ``opalctl compare --metric`` (``compare.aggregate``) both take
a list of values that must each be one of a known list; both refuse the first unknown one in one sentence that
names it and lists the known ones. Each caller words its own sentence (the tests pin them): this module owns only
the check and the order of what is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from opalctl.errors import BadInput

Value = TypeVar("Value")


def known_only(asked: Iterable[Value], known: Iterable[Value],
               refusal: Callable[[Value, list[Value]], str]) -> list[Value]:
    """``asked``, each value once in the order first asked; ``BadInput(refusal(first unknown, known))`` when one
    of them is not in ``known``."""
    known = list(known)
    asked = list(asked)
    unknown = [value for value in asked if value not in known]
    if unknown:
        raise BadInput(refusal(unknown[0], known))
    return list(dict.fromkeys(asked))
