"""The Claude Code CLI agent (``backend: claude-code``): the ``claude`` command, headless, in the run's workspace.

Each decision runs, with the workspace as its working folder and the decision message on its standard input::

    claude -p --output-format json
           --allowedTools Read,Edit,Write,Glob,Grep
           --disallowedTools Bash,WebFetch,WebSearch,NotebookEdit,Task
           --strict-mcp-config
           --append-system-prompt <how to work in the workspace and how to end>
           [--model MODEL] [--max-turns TURNS] [--resume SESSION]

- ``-p`` (print mode) answers once and exits; ``--output-format json`` prints one JSON object with the final text
  (``result``, the rationale), ``session_id``, ``total_cost_usd``, ``usage`` and ``is_error``.
- The tools are the file tools only: reading, editing and writing files (Claude Code confines them to its working
  folder, the workspace, unless told otherwise), and finding files; running commands, the web, notebooks and
  sub-agents are refused, and ``--strict-mcp-config`` without ``--mcp-config`` loads no MCP server.
- ``--resume`` continues the session of the previous decision (its ``session_id``), so the agent remembers what
  it did; a resumed decision gets the message without the prompt, which the session already holds.
- The message goes on standard input, not on the command line (it holds both programs and can be long).

The command runs in its own process group (``start_new_session``); past ``seconds_per_decision`` the whole group
is sent SIGTERM and then SIGKILL (``os.killpg``), and the decision fails (training goes on). The binary is
``claude`` on the PATH, or ``OPALCTL_CLAUDE_BIN``, or the ``binary`` option; a missing one is refused when the
run starts. The cost is the CLI's own figure, ``total_cost_usd``. Only the JSON answer is recorded (Claude Code
keeps its own session log under ``~/.claude``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.opal.agents.base import Answer, Backend, BackendKind
from opalctl.opal.agents.options import ModelOptions
from opalctl.opal.messages import prompt_text
from opalctl.opal.prices import default_prices

DEFAULT_BINARY = "claude"
BINARY_ENV = "OPALCTL_CLAUDE_BIN"
ALLOWED_TOOLS = "Read,Edit,Write,Glob,Grep"
DISALLOWED_TOOLS = "Bash,WebFetch,WebSearch,NotebookEdit,Task"
KILL_GRACE_SECONDS = 2.0
MAX_RECORDED_CHARS = 20_000

INSTRUCTIONS = """\
You are working in a folder (the workspace) that holds updater.py and analysis.py as they run now. Read and edit
only these files, with your file tools, in this folder; nothing else is loaded. To keep the programs, change
nothing. When you are done, answer with your rationale only: that text is recorded as your decision."""


class ClaudeCodeBackend(Backend):
    name = "claude-code"
    runs_in = "host"  # the CLI talks to the network and edits the workspace

    def __init__(self, model: str | None = None, turns: int | None = None,
                 seconds_per_decision: float = ModelOptions().seconds_per_decision,
                 prompt_text: str | None = None, binary: str | None = None, env: dict[str, str] | None = None):
        found, missing = _find_binary(binary)
        if missing:
            raise BadInput(missing)
        self.binary = found
        self.model = model
        self.turns = turns
        self.seconds_per_decision = float(seconds_per_decision)
        self.prompt_text = prompt_text
        self.env = env
        self.session_id: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "binary": self.binary, "model": self.model, "turns": self.turns,
                "seconds_per_decision": self.seconds_per_decision, "allowed_tools": ALLOWED_TOOLS,
                "disallowed_tools": DISALLOWED_TOOLS}

    def recipe(self) -> dict[str, Any]:
        return {"backend": self.name, "options": {"model": self.model, "turns": self.turns,
                                                  "seconds_per_decision": self.seconds_per_decision,
                                                  "prompt_text": self.prompt_text, "binary": self.binary,
                                                  "env": self.env}}

    def carry(self) -> dict[str, Any]:
        """The session the next decision resumes."""
        return {"session_id": self.session_id}

    def resume(self, carried: dict[str, Any]) -> None:
        self.session_id = carried.get("session_id")

    def command(self) -> list[str]:
        argv = [self.binary, "-p", "--output-format", "json", "--allowedTools", ALLOWED_TOOLS,
                "--disallowedTools", DISALLOWED_TOOLS, "--strict-mcp-config", "--append-system-prompt", INSTRUCTIONS]
        if self.model:
            argv += ["--model", self.model]
        if self.turns:
            argv += ["--max-turns", str(self.turns)]
        if self.session_id:
            argv += ["--resume", self.session_id]
        return argv

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        resumed = self.session_id is not None
        text = self._without_prompt(message) if resumed else message
        argv = self.command()
        transcript: list[dict[str, Any]] = [{"event": "command", "argv": argv, "cwd": str(workspace),
                                             "resumed": resumed, "stdin": _shorten(text)}]
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=str(workspace), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, env=self._environment())
        timed_out = False
        try:
            stdout, stderr = process.communicate(text.encode("utf-8"), timeout=self.seconds_per_decision)
        except subprocess.TimeoutExpired:
            timed_out = True
            stdout, stderr = self._kill(process)
        seconds = time.monotonic() - started
        out_text = stdout.decode("utf-8", errors="replace")
        err_text = stderr.decode("utf-8", errors="replace")
        transcript.append({"event": "exit", "returncode": process.returncode, "seconds": seconds,
                           "timed_out": timed_out, "stdout": _shorten(out_text), "stderr": _shorten(err_text[-4000:])})
        if timed_out:
            return Answer(rationale="", transcript=transcript,
                          failed=f"the claude command ran past the decision's limit of {self.seconds_per_decision:g} s "
                                 f"(arms.NAME.agent.seconds_per_decision); its process group was killed")
        result = _parse(out_text)
        usage = dict(result.get("usage") or {}) if isinstance(result.get("usage"), dict) else {}
        if result.get("num_turns") is not None:
            usage["turns"] = result["num_turns"]
        cost = result.get("total_cost_usd", result.get("cost_usd"))
        cost = float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else 0.0
        if result.get("session_id"):
            self.session_id = str(result["session_id"])
        if process.returncode != 0 or not result or result.get("is_error"):
            if resumed:
                self.session_id = None  # start a fresh session next time rather than resume a broken one
            why = (result.get("result") or result.get("subtype") or err_text.strip()[-500:] or out_text.strip()[-500:]
                   or "no output")
            return Answer(rationale="", usage=usage, cost_usd=cost, transcript=transcript,
                          failed=f"the claude command failed (exit {process.returncode}): {str(why).strip()}")
        rationale = str(result.get("result") or "").strip() or "(the agent gave no rationale)"
        return Answer(rationale=rationale, usage=usage, cost_usd=cost, transcript=transcript)

    def _kill(self, process: subprocess.Popen) -> tuple[bytes, bytes]:
        """End the command's whole process group: SIGTERM, a short grace, then SIGKILL."""
        group = process.pid  # the leader of its own session and group (start_new_session)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGTERM:
                try:
                    process.wait(timeout=KILL_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
        try:
            return process.communicate(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:  # something outside the group still holds the pipes
            process.kill()
            return b"", b""

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env or {})
        return env

    def _without_prompt(self, message: str) -> str:
        prompts = [self.prompt_text] if self.prompt_text else []
        if not prompts:
            prompts = [prompt_text("neutral"), prompt_text("aggressive")]
        for prompt in prompts:
            if message.startswith(prompt):
                return message[len(prompt):].lstrip()
        return message


class ClaudeCodeOptions(ModelOptions):
    """The protocol keys this backend reads: model (the CLI's own default when None), turns, seconds_per_decision."""


def _parse(text: str) -> dict[str, Any]:
    """The CLI's JSON answer: one object, or (with --verbose) a list of messages ending with the result."""
    text = text.strip()
    if not text:
        return {}
    candidates = [text] + [line for line in reversed(text.splitlines()) if line.strip().startswith(("{", "["))]
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(data, list):
            results = [d for d in data if isinstance(d, dict) and d.get("type") == "result"]
            data = results[-1] if results else {}
        if isinstance(data, dict):
            return data
    return {}


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_RECORDED_CHARS else text[:MAX_RECORDED_CHARS] + "... (cut)"


def _find_binary(binary: str | None) -> tuple[str, str | None]:
    """The CLI's absolute path, or what to do when there is none: ``binary``, else $OPALCTL_CLAUDE_BIN, else
    ``claude`` on the PATH."""
    chosen = binary or os.environ.get(BINARY_ENV) or DEFAULT_BINARY
    found = shutil.which(chosen)
    if found is None:
        return "", (f"agent backend 'claude-code' needs the Claude Code CLI {chosen!r}, which was not found or is not "
                    f"executable; install it (npm install -g @anthropic-ai/claude-code) or set {BINARY_ENV} to its "
                    f"path")
    return os.path.abspath(found), None


def unready(agent: ClaudeCodeOptions) -> str | None:
    return _find_binary(None)[1]  # a protocol names no binary: the environment's or the PATH's


def problems(agent, where: str) -> list[tuple[str, str]]:
    """A cost cap expects a decision of the model the CLI calls to cost what the price table says of it
    (``opalctl.opal.decisions.CostCap``): a named model the table does not list cannot be capped."""
    if agent.max_cost_usd is not None and agent.model and default_prices(agent.model) is None:
        return [("max_cost_usd", f"model {agent.model!r} is not in the price table (opalctl/opal/prices.py), so "
                                 f"{where}.max_cost_usd cannot expect a decision's cost; name a listed model or leave "
                                 f"max_cost_usd out")]
    return []


KIND = BackendKind(name="claude-code", waits=True, factory=ClaudeCodeBackend, options=ClaudeCodeOptions,
                   prompted=True, unready=unready, problems=problems)
