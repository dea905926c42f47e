"""The one table of model prices: US dollars per million tokens (input, output, cache read, cache write with the
5-minute cache) for each model an agent may call, and the arithmetic on them.

Read by the ``anthropic`` backend (the cost of each decision from its token usage, and the default of a protocol's
``arms.NAME.agent.prices``), by ``opalctl.opal.estimate`` (the measured per-decision cost, priced for another model)
and so by the cost cap (``max_cost_usd``, ``opalctl.opal.decisions``), which expects a first decision of the model
the backend calls to cost what ``estimate`` forecasts for it. The prices are the public list prices as of this
writing; a protocol's ``prices`` override them, and must be given for a model not listed here. This module imports
nothing, so the command line can read it without loading pydantic or torch.
"""

from __future__ import annotations

import re
from typing import Any

from opalctl.opal.agents.default_model import DEFAULT_MODEL

PRICE_KEYS = ("input", "output", "cache_read", "cache_write")

# DEFAULT_MODEL, the model of the measured figures in estimate.py, is priced like the current Opus list price
DEFAULT_PRICES: dict[str, tuple[float, float, float, float]] = {
    DEFAULT_MODEL: (5.0, 25.0, 0.50, 6.25),
    "claude-opus-4-5": (5.0, 25.0, 0.50, 6.25),
    "claude-opus-4-1": (15.0, 75.0, 1.50, 18.75),
    "claude-opus-4-0": (15.0, 75.0, 1.50, 18.75),
    "claude-sonnet-4-5": (3.0, 15.0, 0.30, 3.75),
    "claude-sonnet-4-0": (3.0, 15.0, 0.30, 3.75),
    "claude-haiku-4-5": (1.0, 5.0, 0.10, 1.25),
    "claude-3-5-haiku": (0.80, 4.0, 0.08, 1.0),
}


def default_prices(model: str | None) -> dict[str, float] | None:
    """The listed prices of ``model`` (None when it has none): an exact name, or one with a date suffix."""
    if not model:
        return None
    row = DEFAULT_PRICES.get(re.sub(r"-(\d{8}|latest)$", "", model))
    return dict(zip(PRICE_KEYS, row)) if row is not None else None


def price_dict(prices: Any) -> dict[str, float] | None:
    """Prices given as a mapping (or a pydantic model of one), every key filled (0 when absent)."""
    if prices is None:
        return None
    if hasattr(prices, "model_dump"):
        prices = prices.model_dump()
    return {key: float(prices.get(key) or 0.0) for key in PRICE_KEYS}


def cost_of(usage: dict[str, Any], prices: dict[str, float]) -> float:
    """US dollars for ``usage`` (token counts as the API reports them) at ``prices`` (per million tokens)."""
    return (usage.get("input_tokens", 0) * prices["input"] + usage.get("output_tokens", 0) * prices["output"]
            + usage.get("cache_read_input_tokens", 0) * prices["cache_read"]
            + usage.get("cache_creation_input_tokens", 0) * prices["cache_write"]) / 1e6


def price_ratio(prices: dict[str, float], reference: dict[str, float]) -> float:
    """How many times dearer ``prices`` are than ``reference``: the largest ratio over the kinds of token, so that
    tokens counted for the reference model are never priced below what they may cost (the listed models' prices
    are in one proportion, so for them every kind gives the same ratio)."""
    return max(prices[key] / reference[key] for key in PRICE_KEYS if reference[key] > 0)
