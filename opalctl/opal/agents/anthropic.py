"""The Anthropic Messages API agent (``backend: anthropic``): a tool-use loop over the run's workspace.

For each decision the agent gets the prompt (neutral or aggressive) and the tool instructions below as its
system prompt (cached with ``cache_control``), the decision message as its first user turn, and five tools that
act on the workspace only:

    list_files       the files of the workspace (or of a folder in it)
    read_file        one file's text
    write_file       a whole file (path, content)
    replace_text     one unique piece of text in a file (path, old, new)
    check_programs   a dry run of the workspace's updater.py and analysis.py: the static check, build() on
                     stand-in tensors of the run's real parameter shapes and dtypes wrapped in a fresh AdamW, one
                     step on random gradients, state_dict()/load_state_dict(), one analyze(); the error text, if any
                     (``opalctl.opal.agents.dry_run``)

Paths are confined to the workspace (``opalctl.opal.agents.workspace``): an absolute path, a ``..`` part, or a
symlink on the way is refused (a write replaces a link, never follows it), and so is a write past the files or
bytes one decision may write; the refusal is the tool's result (the agent reads it and goes on). The
optimizer's own folder ``.opal`` is read-only. The loop ends when the agent answers without a tool call; that final text is the rationale. Each
decision has at most ``turns`` requests and ``seconds_per_decision`` seconds; the last turn is sent with tools
switched off, so the agent must end with its rationale.

Errors: *unavailable* (429 rate limit, 529 overloaded, other 5xx, 408, a connection error or timeout) waits with
exponential backoff (or the server's ``retry-after``) and retries, up to ``retries`` times per request: the
decision goes on. *Failed* (400, 401, 403, 404 and every other 4xx) ends the decision at once with a clear
message: the optimizer records a ``decision_failed`` event and training goes on with the programs it has.

Cost of a decision = its summed token usage times the model's prices (USD per million tokens). The API key comes
from ``ANTHROPIC_API_KEY`` (or ``api_key=``) and is only ever handed to the SDK, in the agent host's worker, where
the client is made; ``secrets()`` gives it to the redaction so that anything that would carry it is redacted. In
an ``opalctl run`` process the key was handed to the host (``opalctl.opal.handover``): the backend built in the
training process holds none. The whole decision runs in a worker of the agent host (``opalctl.opal.agents.host``),
and each ``check_programs`` in a child of its own without the key. ``base_url=`` or ``ANTHROPIC_BASE_URL`` points the
client at another server (the tests use a loopback one).
"""

from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from opalctl.errors import BadInput
from opalctl.opal.agents.base import Answer, Backend, BackendKind
from opalctl.opal.agents.default_model import DEFAULT_EFFORT, DEFAULT_MODEL
from opalctl.opal.agents.dry_run import DRY_RUN_SECONDS, check_in_child
from opalctl.opal.agents.options import ModelOptions, Strict
from opalctl.opal.agents.workspace import Refused, Workspace, read_program
from opalctl.opal.handover import handed_over_names
from opalctl.opal.messages import prompt_text
from opalctl.opal.prices import DEFAULT_PRICES, PRICE_KEYS, cost_of, default_prices, price_dict
from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import SecretRedaction

__all__ = ["AnthropicBackend", "AnthropicOptions", "Prices", "DEFAULT_PRICES", "PRICE_KEYS", "cost_of",
           "default_prices"]  # the prices are the one table's (opalctl.opal.prices), named here for the backend's users

# models that take `output_config.effort`; for any other model the effort setting is not sent
EFFORT_MODELS = (DEFAULT_MODEL, "claude-opus-4-5")
USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
RETRYABLE_STATUS = (408, 429)  # and every 5xx (500, 502, 503, 504, 529 overloaded)
MAX_BACKOFF_SECONDS = 60.0
MAX_RECORDED_CHARS = 20_000

TOOL_INSTRUCTIONS = """\
## Your tools

You work in a folder (the workspace) that holds `updater.py` and `analysis.py` as they run now. Paths are relative
to it; absolute paths, `..` and links out of it are refused.

- `list_files` lists the files of the workspace.
- `read_file` returns a file's text.
- `write_file` replaces a whole file (`path`, `content`).
- `replace_text` replaces one piece of text that occurs exactly once in a file (`path`, `old`, `new`).
- `check_programs` dry-runs the workspace's programs: the load-time check, `build()` on stand-in tensors of the
  run's parameter shapes and dtypes (wrapped in a fresh AdamW), one step on random gradients, `state_dict()` /
  `load_state_dict()`, and one `analyze()`. It returns "ok" or the error. Run it after every edit and fix what it
  reports: a program that fails when it is loaded is not applied.

Only `updater.py` and `analysis.py` are loaded; other files are ignored. To keep the programs, change nothing.
When you are done, stop calling tools and answer with your rationale only; that text is recorded as your
decision. Each decision has a limited number of turns; the last one has no tools."""

TOOLS: list[dict[str, Any]] = [
    {"name": "list_files", "description": "List the files of the workspace (or of one folder in it), with sizes.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "a folder relative to the workspace; default: the workspace"}}}},
    {"name": "read_file", "description": "Return the text of one file of the workspace.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "relative to the workspace, e.g. updater.py"}},
         "required": ["path"]}},
    {"name": "write_file", "description": "Write a whole file of the workspace (it is replaced).",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "relative to the workspace, e.g. updater.py"},
         "content": {"type": "string", "description": "the complete new text of the file"}},
         "required": ["path", "content"]}},
    {"name": "replace_text", "description": "Replace a piece of text that occurs exactly once in a file.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "relative to the workspace, e.g. updater.py"},
         "old": {"type": "string", "description": "the exact text to replace; it must occur exactly once"},
         "new": {"type": "string", "description": "the text to put in its place"}},
         "required": ["path", "old", "new"]}},
    {"name": "check_programs", "description": "Dry-run updater.py and analysis.py of the workspace on stand-in "
                                              "tensors of the run's real shapes; returns 'ok' or the error.",
     "input_schema": {"type": "object", "properties": {}}},
]


# -- the protocol's settings --------------------------------------------------------------------------------------

class Prices(Strict):
    """US dollars per million tokens."""

    input: Annotated[float, Field(ge=0)]
    output: Annotated[float, Field(ge=0)]
    cache_read: Annotated[float, Field(ge=0)] = 0.0
    cache_write: Annotated[float, Field(ge=0)] = 0.0


class AnthropicOptions(ModelOptions):
    """The protocol keys this backend reads (besides model, turns and seconds_per_decision)."""

    effort: Literal["low", "medium", "high"] = DEFAULT_EFFORT
    max_tokens: Annotated[int, Field(ge=256)] = 8192
    retries: Annotated[int, Field(ge=0)] = 4
    prices: Prices | None = None  # None: the model's DEFAULT_PRICES


OPTION_DEFAULTS = AnthropicOptions()


# -- the backend -------------------------------------------------------------------------------------------------

class AnthropicBackend(Backend):
    name = "anthropic"
    runs_in = "host"  # it talks to the network and dry-runs the agent's programs
    backoff_seconds = 2.0  # the first wait after an unavailable answer without retry-after; doubles each time

    def __init__(self, model: str | None = None, max_tokens: int = OPTION_DEFAULTS.max_tokens,
                 turns: int = OPTION_DEFAULTS.turns, seconds_per_decision: float = OPTION_DEFAULTS.seconds_per_decision,
                 retries: int = OPTION_DEFAULTS.retries, prices: Any = None,
                 prompt_text: str | None = None, api_key: str | None = None, base_url: str | None = None,
                 effort: str | None = None):
        self.model = model or DEFAULT_MODEL
        self.max_tokens = int(max_tokens)
        self.turns = int(turns)
        self.seconds_per_decision = float(seconds_per_decision)
        self.retries = int(retries)
        self.prices = price_dict(prices) or default_prices(self.model)
        if self.prices is None:
            raise BadInput(f"agent model {self.model!r} has no default prices; give them as "
                           f"arms.NAME.agent.prices (input, output, cache_read, cache_write in USD per million tokens)")
        self.prompt_text = prompt_text
        self.effort = effort if self.model in EFFORT_MODELS else None
        self._key_given = bool(api_key)  # a key from the environment is not passed on: the host holds it
        self._api_key = api_key or os.environ.get("ANTHROPIC_API_KEY") or None
        # an `opalctl run` process handed the key to its agent host without holding it (opalctl.opal.handover):
        # the backend it builds has none, and the one the host's worker builds from the recipe takes it there
        if not self._api_key and (missing := unready(None)):
            raise BadInput(missing)
        try:
            import anthropic
        except ImportError:  # pragma: no cover - a dependency of opalctl
            raise BadInput("agent backend 'anthropic' needs the anthropic package: pip install anthropic") from None
        self._sdk = anthropic
        self.base_url = base_url or os.environ.get("ANTHROPIC_BASE_URL") or None
        self._client = None

    @property
    def client(self):
        """The SDK's client, made where a decision is worked (the host's worker, which holds the key). The SDK's
        own retries are off: this backend retries itself, records each attempt and keeps to the decision's time
        limit."""
        if self._client is None:
            self._client = self._sdk.Anthropic(api_key=self._api_key, base_url=self.base_url, max_retries=0,
                                               open_telemetry=False)
        return self._client

    def secrets(self) -> list[str]:
        """The API key, for the redaction (never for a file); none where this process does not hold it."""
        return [self._api_key] if self._api_key else []

    def recipe(self) -> dict[str, Any]:
        options = {"model": self.model, "max_tokens": self.max_tokens, "turns": self.turns,
                   "seconds_per_decision": self.seconds_per_decision, "retries": self.retries,
                   "prices": self.prices, "prompt_text": self.prompt_text, "base_url": self.base_url,
                   "effort": self.effort}
        if self._key_given:
            options["api_key"] = self._api_key
        return {"backend": self.name, "options": options}

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.model, "max_tokens": self.max_tokens, "turns": self.turns,
                "seconds_per_decision": self.seconds_per_decision, "retries": self.retries, "prices": self.prices,
                "effort": self.effort, "base_url": self.base_url}

    # -- one decision ------------------------------------------------------------------------------------------
    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        deadline = time.monotonic() + self.seconds_per_decision
        space = Workspace(workspace, redaction=SecretRedaction(self.secrets(), environ=os.environ))
        running = {name: read_program(Path(workspace), name)[0] for name in PROGRAM_FILES}
        prompt = self._prompt_for(message)
        system = (prompt.rstrip() + "\n\n" + TOOL_INSTRUCTIONS) if prompt else TOOL_INSTRUCTIONS
        user = message[len(prompt):].lstrip() if prompt and message.startswith(prompt) else message
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": user}]}]
        usage = {key: 0 for key in USAGE_KEYS}
        usage["requests"] = 0
        transcript: list[dict[str, Any]] = [{"event": "start", "model": self.model, "max_tokens": self.max_tokens,
                                             "turns": self.turns, "system": system, "tools": TOOLS, "user": user}]

        def answer(rationale: str = "", failed: str | None = None) -> Answer:
            cost = cost_of(usage, self.prices)
            transcript.append({"event": "end", "usage": dict(usage), "cost_usd": cost, "failed": failed})
            return Answer(rationale=rationale, usage=dict(usage), cost_usd=cost, transcript=transcript, failed=failed)

        for turn in range(1, self.turns + 1):
            last = turn == self.turns
            request: dict[str, Any] = {
                "model": self.model, "max_tokens": self.max_tokens, "tools": TOOLS, "messages": _mark_cache(messages),
                "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}
            if last:
                request["tool_choice"] = {"type": "none"}
            if self.effort:
                request["output_config"] = {"effort": self.effort}
            response, failure = self._create(request, deadline, transcript, turn)
            if failure is not None:
                return answer(failed=failure)
            usage["requests"] += 1
            for key in USAGE_KEYS:
                usage[key] += int(getattr(response.usage, key, 0) or 0)
            content = [_block_param(block) for block in response.content]
            messages.append({"role": "assistant", "content": content})
            text = "\n".join(block["text"] for block in content if block.get("type") == "text").strip()
            calls = [block for block in content if block.get("type") == "tool_use"]
            if not calls:
                return answer(rationale=text or "(the agent gave no rationale)")
            if last:
                break
            results: list[dict[str, Any]] = []
            for call in calls:
                started = time.monotonic()
                result, is_error = self._tool(space, call["name"], call.get("input") or {}, facts, running,
                                              deadline)
                transcript.append({"event": "tool", "turn": turn, "name": call["name"],
                                   "input": _shorten(call.get("input")), "result": _shorten(result),
                                   "is_error": is_error, "seconds": time.monotonic() - started})
                results.append({"type": "tool_result", "tool_use_id": call["id"], "content": result,
                                "is_error": is_error})
            if turn + 1 == self.turns:
                results.append({"type": "text", "text": "This is your last turn: tools are off now. End with your "
                                                        "rationale."})
            messages.append({"role": "user", "content": results})
        return answer(failed=f"the agent used all {self.turns} turns without finishing (arms.NAME.agent.turns); "
                             f"its edits were not applied")

    def _prompt_for(self, message: str) -> str:
        if self.prompt_text is not None:
            return self.prompt_text

        for name in ("neutral", "aggressive"):
            text = prompt_text(name)
            if message.startswith(text):
                return text
        return ""

    def _create(self, request: dict[str, Any], deadline: float, transcript: list, turn: int):
        """One request, retried while the API is unavailable; (response, None) or (None, why it failed)."""
        sdk = self._sdk
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, (f"the decision ran past its limit of {self.seconds_per_decision:g} s "
                              f"(arms.NAME.agent.seconds_per_decision)")
            started = time.monotonic()
            retry_after = None
            try:
                response = self.client.messages.create(**request, timeout=remaining)
            except sdk.APIStatusError as error:
                status = error.status_code
                retryable = status in RETRYABLE_STATUS or status >= 500
                detail = f"HTTP {status}" + (f" {error.type}" if error.type else "") + \
                         f": {error.api_message or error.message}"
                retry_after = _retry_after(error.response.headers)
            except sdk.APIConnectionError as error:
                status, retryable = None, True
                detail = f"{type(error).__name__}: {error}"
            else:
                transcript.append({"event": "response", "turn": turn, "seconds": time.monotonic() - started,
                                   "stop_reason": response.stop_reason, "usage": _usage(response.usage),
                                   "content": [_shorten(_block_param(b)) for b in response.content]})
                return response, None
            transcript.append({"event": "error", "turn": turn, "attempt": attempt + 1, "status": status,
                               "retryable": retryable, "message": detail, "seconds": time.monotonic() - started})
            if not retryable:
                return None, _failed_text(status, detail, self.model)
            if attempt >= self.retries:
                return None, (f"unavailable: the API did not answer after {attempt + 1} attempt(s) (last: {detail}); "
                              f"the decision is given up and training goes on")
            wait = retry_after if retry_after is not None else min(MAX_BACKOFF_SECONDS,
                                                                   self.backoff_seconds * 2 ** attempt)
            if time.monotonic() + wait >= deadline:
                return None, (f"unavailable ({detail}), and waiting {wait:g} s more would run past the decision's "
                              f"limit of {self.seconds_per_decision:g} s")
            transcript.append({"event": "retry", "turn": turn, "attempt": attempt + 2, "wait_seconds": wait})
            time.sleep(wait)
            attempt += 1

    def _tool(self, space: Workspace, name: str, arguments: dict[str, Any], facts: dict[str, Any],
              running: dict[str, str], deadline: float) -> tuple[str, bool]:
        if not isinstance(arguments, dict):
            return "the tool's input must be an object", True
        try:
            if name == "list_files":
                return space.list_files(arguments.get("path")), False
            if name == "read_file":
                return space.read(arguments.get("path")), False
            if name == "write_file":
                return space.write(arguments.get("path"), arguments.get("content")), False
            if name == "replace_text":
                return space.replace(arguments.get("path"), arguments.get("old"), arguments.get("new")), False
            if name == "check_programs":
                seconds = min(DRY_RUN_SECONDS, deadline - time.monotonic())
                problem = check_in_child(space.root, facts, running, seconds)
                return ("ok: both programs load, build, step and analyse on stand-in tensors of the run's shapes"
                        if problem is None else problem), problem is not None
        except Refused as refusal:
            return f"refused: {refusal}", True
        except OSError as error:
            return f"{type(error).__name__}: {error}", True
        return f"unknown tool {name!r}; the tools are {', '.join(t['name'] for t in TOOLS)}", True


def _failed_text(status: int | None, detail: str, model: str) -> str:
    if status == 401:
        return f"failed: the API refused the key ({detail}); check ANTHROPIC_API_KEY"
    if status == 403:
        return f"failed: the key may not use this ({detail}); check the key's permissions"
    if status == 404:
        return f"failed: not found ({detail}); check that the model {model!r} exists (arms.NAME.agent.model)"
    if status == 400:
        return f"failed: the API refused the request ({detail})"
    return f"failed: {detail}"


def _retry_after(headers) -> float | None:
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name) if headers is not None else None
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if math.isfinite(seconds):
            return min(max(seconds, 0.0), MAX_BACKOFF_SECONDS * 2)
    return None


def _usage(usage: Any) -> dict[str, int]:
    return {key: int(getattr(usage, key, 0) or 0) for key in USAGE_KEYS}


def _block_param(block: Any) -> dict[str, Any]:
    """A response content block as a request content block (what goes back in the next request)."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return {"type": "text", "text": block.text}
    if kind == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    return block.model_dump(mode="json", exclude_none=True) if hasattr(block, "model_dump") else dict(block)


def _mark_cache(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with a cache breakpoint on the last block of the last user turn (the conversation so far is
    read from the cache on the next turn)."""
    marked = copy.deepcopy(messages)
    for message in reversed(marked):
        if message["role"] == "user" and message["content"]:
            message["content"][-1]["cache_control"] = {"type": "ephemeral"}
            break
    return marked


def _shorten(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_RECORDED_CHARS:
        return value[:MAX_RECORDED_CHARS] + f"... (cut at {MAX_RECORDED_CHARS} of {len(value)} characters)"
    if isinstance(value, dict):
        return {k: _shorten(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten(v) for v in value]
    return value


# -- what the registry knows of this backend ---------------------------------------------------------------------

def lock_defaults(agent: dict[str, Any]) -> dict[str, Any]:
    """The lock names the model and the prices the run will use, not "whatever the default was then"."""
    model = agent["model"] or DEFAULT_MODEL
    return {"model": model, "prices": agent["prices"] or default_prices(model)}


def problems(agent: AnthropicOptions, where: str) -> list[tuple[str, str]]:
    """A model without default prices needs prices in the protocol (the cost of each decision is recorded)."""
    model = agent.model or DEFAULT_MODEL
    if agent.prices is None and default_prices(model) is None:
        return [("model", f"model {model!r} has no default prices; give {where}.prices (input, output, cache_read, "
                          f"cache_write in USD per million tokens)")]
    return []


def unready(agent: AnthropicOptions | None) -> str | None:
    """The key a protocol's arm cannot name: the environment's, or one `opalctl run` handed to this process."""

    if os.environ.get("ANTHROPIC_API_KEY") or "ANTHROPIC_API_KEY" in handed_over_names():
        return None
    return ("agent backend 'anthropic' needs an API key: set ANTHROPIC_API_KEY in the environment of opalctl (it "
            "is never written to any file)")


KIND = BackendKind(name="anthropic", waits=True, factory=AnthropicBackend, options=AnthropicOptions, prompted=True,
                   lock_defaults=lock_defaults, problems=problems, unready=unready)
