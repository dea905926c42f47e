"""The protocol keys a backend reads (``arms.NAME.agent``), as pydantic models, and the strictness they share.

A backend that takes settings declares them as a subclass of ``Options``; the protocol's agent section accepts the
keys of every backend (``opalctl.protocol.schema.AgentSpec`` is made of these models), so a protocol that names
a key another backend reads is accepted as it always was, and each key has its default in exactly one place.
``ModelOptions`` holds the keys every backend that asks a language model reads.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """The protocol's strictness: unknown keys are refused, types are not coerced, numbers are finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Options(Strict):
    """A backend's keys of the protocol's agent section; its field names are its constructor's keyword names."""


class ModelOptions(Options):
    """What every backend that asks a language model reads: which model, and how long a decision may take."""

    model: str | None = None  # None: the backend's own default (the anthropic backend's is DEFAULT_MODEL)
    turns: Annotated[int, Field(ge=1)] = 24
    seconds_per_decision: Annotated[float, Field(gt=0)] = 900.0
