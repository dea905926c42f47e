"""Why an arm kept the anchor on every seed: the promotion rule that refused its stages most often.

When no stage of any seed qualified, every compared value of the selected model is the anchor's and every paired
difference is zero; the one useful fact left is which rule stood in the way, counted over every refused stage's
failed checks (a stage refused by two rules counts for both).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def refusing_rules(reports: list[dict[str, Any]]) -> Counter:
    """(rule, metric) -> the number of refused stages whose checks failed it."""
    counts: Counter = Counter()
    for report in reports:
        for stage in report["stages"]:
            if stage.get("promoted"):
                continue
            failed = {(c.get("rule"), c.get("metric")) for c in (stage.get("decision") or {}).get("checks", [])
                      if not c.get("passed", True)}
            counts.update(failed)
    return counts


def anchor_note(arm: str, reports: list[dict[str, Any]]) -> str | None:
    """One sentence when ``arm`` kept the anchor on every seed, naming the rule that refused most often."""
    if not reports or any(r["selected"]["source"] != "anchor" for r in reports):
        return None
    stages = sum(len(r["stages"]) for r in reports)
    sentence = (f"{arm} kept the anchor on every seed ({len(reports)} of {len(reports)}): no stage qualified, so "
                f"its selected values are the anchor's")
    counts = refusing_rules(reports)
    if not counts:
        return sentence + "."
    (rule, metric), times = counts.most_common(1)[0]  # ties: the rule met first
    return sentence + f"; the rule that refused most often was {rule} on {metric} ({times} of {stages} stages)."
