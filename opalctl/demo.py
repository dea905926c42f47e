"""``opalctl demo``: everything that exists, end to end, on the built-in ``digits`` task and its defaults.

Today that is init, freeze, verify and a pilot of every arm. It is the quickest way to see on a new machine
that the pieces fit, and ``make demo`` runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


def demo(folder: str | Path, *, steps: int = 24, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from opalctl.driver.pilot import pilot
    from opalctl.errors import InputChanged
    from opalctl.protocol.freeze import freeze
    from opalctl.protocol.verify import verify
    from opalctl.tasks.builtin import init

    folder = Path(folder)
    say(f"[1/4] init digits in {folder}")
    created = init("digits", folder)
    say(f"[2/4] freeze {created['protocol']}")
    frozen = freeze(created["protocol"], force=True)
    say(f"[3/4] verify {frozen['lock']}")
    checked = verify(frozen["lock"])
    if not checked["ok"]:
        raise InputChanged(f"lock {frozen['lock']} does not verify right after freezing")
    pilots = []
    for index, arm in enumerate(frozen["arms"]):
        say(f"[4/4] pilot {arm} ({index + 1}/{len(frozen['arms'])}, {steps} updates)")
        pilots.append(pilot(frozen["lock"], arm, steps=steps))
    return {"folder": str(folder), "protocol": created["protocol"], "lock": frozen["lock"],
            "sha256": frozen["sha256"], "verified_records": checked["checked"], "pilots": pilots}
