"""The keep backend (``backend: keep``): it never changes anything, so the run trains as the plain optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.opal.agents.base import Answer, Backend, BackendKind


class KeepBackend(Backend):
    name = "keep"
    runs_in = "here"  # it runs no code and talks to no one

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        return Answer(rationale="Observed: nothing was examined (the keep backend never changes anything).\n"
                                "Kept: the programs as they are.\n"
                                "Prediction: training continues exactly as the plain optimizer would.\n"
                                "Rules: none.")


KIND = BackendKind(name="keep", waits=False, factory=KeepBackend)
