"""A decision answered in a child process: ``python -m opalctl.opal.agents.worker BACKEND WORKSPACE``.

Non-blocking decisions of backends that compute (the heuristic) run here, so that their CPU time never lands on
the training process's clock (``time.process_time`` counts every thread of a process, and no child). The worker
reads the message and facts the optimizer left in ``WORKSPACE/.opal/``, edits the programs in the workspace, and
writes ``.opal/answer.json`` with the rationale (or the failure).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    backend_name, workspace = argv[0], Path(argv[1])
    from opalctl.opal.agents import make_backend

    meta = workspace / ".opal"
    message = (meta / "message.md").read_text(encoding="utf-8")
    facts = json.loads((meta / "facts.json").read_text(encoding="utf-8"))
    try:
        answer = make_backend(backend_name).decide(workspace, message, facts)
        result = {"rationale": answer.rationale, "failed": answer.failed, "usage": answer.usage,
                  "cost_usd": answer.cost_usd}
    except Exception as error:
        result = {"rationale": "", "failed": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}"}
    temporary = meta / "answer.json.tmp"
    temporary.write_text(json.dumps(result), encoding="utf-8")
    temporary.replace(meta / "answer.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
