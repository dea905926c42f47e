"""Short column labels for long metric names, so a table of every metric stays legible at 100 columns.

``development.correct`` becomes ``dev.corr``: the split cut to three letters and the rest to four, made unique
with a digit where two would meet. The legend lists each label beside the name it stands for.
"""

from __future__ import annotations


def short_labels(names: list[str]) -> dict[str, str]:
    """name -> label, in the order given; a name of ten characters or fewer is its own label."""
    labels: dict[str, str] = {}
    for name in names:
        split, dot, rest = name.partition(".")
        label = name if len(name) <= 10 else (split[:3] + dot + rest[:4] if dot else name[:8])
        candidate, number = label, 2
        while candidate in labels.values():
            candidate, number = f"{label}{number}", number + 1
        labels[name] = candidate
    return labels


def legend(labels: dict[str, str]) -> str:
    """``dev.corr = development.correct, ...`` for every label that differs from its name; '' when none does."""
    return ", ".join(f"{label} = {name}" for name, label in labels.items() if label != name)
