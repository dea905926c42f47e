"""One decision, answered in a worker process of the agent host: ``python -m opalctl.opal.agents.worker [BACKEND]``.

The host starts a worker before its decision (``BACKEND`` names the backend whose module it imports while it
waits), then writes the question on its standard input as one JSON object: the backend's ``recipe``, what the
previous decision's backend ``carry``-ed, the ``workspace`` (always the host's own, fixed when it started, with the
running programs and the facts already written into it by the host), the ``message`` and the ``facts``. The worker
builds the backend, lets it decide and writes ``{"answer", "carry"}`` on its standard output; the host then sweeps
the workspace and reads the programs back itself. Anything the backend prints goes to standard error, which the
host keeps for a failure's message. The worker holds the host's environment (the key), and runs no agent program
itself: the dry run of a program is a child of its own (``opalctl.opal.agents.dry_run``) without the secrets.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from opalctl.formats import WorkerAnswer, WorkerQuestion
from opalctl.opal.agents import Answer, registry

MAX_TRANSCRIPT_CHARS = 1_000_000  # what one decision's transcript may hold once written out


def _capped(transcript: list) -> list:
    """The transcript's entries while they fit in ``MAX_TRANSCRIPT_CHARS``, then one entry saying what was left
    out (the last entry, the end of the decision, is always kept)."""
    sizes = [len(json.dumps(entry, default=str)) for entry in transcript]
    if sum(sizes) <= MAX_TRANSCRIPT_CHARS:
        return transcript
    kept, used = [], len(json.dumps(transcript[-1], default=str)) if transcript else 0
    for entry, size in zip(transcript[:-1], sizes):
        if used + size > MAX_TRANSCRIPT_CHARS:
            break
        kept.append(entry)
        used += size
    left_out = len(transcript) - 1 - len(kept)
    return kept + [{"event": "cut", "entries_left_out": left_out,
                    "reason": f"the transcript is cut at {MAX_TRANSCRIPT_CHARS} characters"}] + transcript[-1:]


def answer(question: WorkerQuestion) -> WorkerAnswer:
    """The worker's answer to one question; a failure is a failed answer."""
    recipe = question.recipe
    carry: dict = {}
    try:
        backend = registry.create(recipe["backend"], **(recipe.get("options") or {}))
        backend.resume(question.carry)
        result = backend.decide(Path(question.workspace), question.message, question.facts)
        result = result if isinstance(result, Answer) else Answer(rationale=str(result))
        carry = backend.carry()
    except Exception as error:  # the agent's failure is a failed decision, never the end of training
        result = Answer(rationale="", failed=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
    result.transcript = _capped(result.transcript)
    return WorkerAnswer(answer=result.to_json(), carry=carry)


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever the backend prints goes to standard error, not into the answer
    if argv and argv[0]:
        registry.find(argv[0])  # import the backend's module while the decision is not yet asked
    question = WorkerQuestion.from_json(json.loads(sys.stdin.read()))
    out.write(json.dumps(answer(question).to_json(), default=str))
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
