"""What a program made, checked by exact type before it is saved or written (``opalctl/opal/plain.py``): a
``state_dict()`` torch cannot save, what ``build()`` leaves in the user's optimizer, an analysis memory or report
holding an object whose ``items()`` never returns. Each is the running program's failure at the checkpoint (or the
analysis) that meets it: the version is reverted, the agent told, the checkpoint written without it (it loads with
``weights_only`` and a resume from it trains on), and training goes on. None of our code calls into such an
object: a check that did would hang, so each call that could is run under a CPU deadline that fails the test
instead.

An exception whose ``__str__`` never returns needs a way past the static check (it refuses ``__str__``); the
``unchecked`` fixture is that way (the check is a lint, not the boundary), and its failure is written without
calling the exception's code.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
import warnings

import pytest
import torch

from opalctl import checkpoints
from opalctl.opal import programs as programs_module
from opalctl.opal import wrap
from opalctl.opal.guard import failure_message, failure_text, trace_of
from opalctl.opal.plain import json_text, plain_optimizer_state, plain_problem

STEPS = 40
AT = 0.125  # the decision falls before update 5
CHECKPOINT_AT = 10  # trial_steps=2: the new version has passed its trial by then
DEADLINE_CPU_SECONDS = 20.0


class Hung(Exception):
    """A call into a program's object did not return within the test's CPU deadline."""


@contextlib.contextmanager
def cpu_deadline(seconds: float = DEADLINE_CPU_SECONDS):
    """Fail with ``Hung`` once this process has spent ``seconds`` of CPU time here: a call looping forever in a
    program's code then fails the test instead of hanging the suite. SIGPROF (a CPU-time timer), because the
    guards own SIGALRM."""
    def expired(signum, frame):
        raise Hung(f"no return after {seconds:g} CPU seconds: our code ran a program's object that never returns")

    previous = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.fixture
def unchecked(monkeypatch):
    """Programs load without the static check: what a way around it would let a program do."""
    monkeypatch.setattr(programs_module, "check_source", lambda source, filename: [])


def wrapped(opal, run_dir, updater=None, analysis=None, **options):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=updater, analysis=analysis), decisions=1,
                     schedule=[AT], total_steps=STEPS, run_dir=run_dir, trial_steps=2, **options)
    return model, optimizer


def events(opal, optimizer, run_dir, kind):
    optimizer.records.flush()
    return opal.of_kind(opal.events(run_dir), kind)


def checkpoint_then_go_on(opal, run_dir, tmp_path, model, optimizer) -> dict:
    """A checkpoint at update 10 as a formal run writes it, read back with ``weights_only``; then training to the
    end, and a resume from the checkpoint training on. Returns the agent optimizer's state as read back."""
    with cpu_deadline():
        state = optimizer.state_dict()
    path = tmp_path / "resume.pt"
    checkpoints.save(path, model.state_dict(), kind="resume", extra={"optimizer": state})
    read = checkpoints.load(path, require_finite=False)["extra"]["optimizer"]
    with cpu_deadline():
        opal.train(model, optimizer, STEPS - CHECKPOINT_AT, start=CHECKPOINT_AT)
    optimizer.close()
    assert optimizer.t == STEPS and all(torch.isfinite(p).all() for p in model.parameters())

    resumed_model = opal.make_model()
    resumed_model.load_state_dict(checkpoints.load(path, require_finite=False)["model"])
    resumed = wrap(opal.adamw(resumed_model), resumed_model, backend=opal.Writer(), decisions=1, schedule=[AT],
                   total_steps=STEPS, run_dir=tmp_path / "resumed")
    resumed.load_state_dict(read)
    opal.train(resumed_model, resumed, 5, start=CHECKPOINT_AT)
    assert resumed.current.number == 0 and resumed.t == CHECKPOINT_AT + 5
    return read


def assert_reverted(opal, optimizer, run_dir, read, words):
    assert read["current"] == 0 and optimizer.figures()["decisions_reverted"] == 1
    reverted = events(opal, optimizer, run_dir, "reverted")
    assert [(e["version"], e["to"], e["update"]) for e in reverted] == [(1, 0, CHECKPOINT_AT)]
    assert all(word in reverted[0]["message"] for word in words), reverted[0]["message"]
    assert any(all(word in error["message"] for word in words) for error in optimizer.observer.errors)
    assert optimizer.slots.fallback is optimizer.slots.versions[0]  # a failed version is no one's fallback


# -- the check itself, and the failure's text ----------------------------------------------------------------------

class Rate(float):
    pass


class Moment(torch.Tensor):
    pass


class Endless(dict):
    def items(self):
        raise AssertionError("the check called items()")


PLAIN = {
    "nested_containers": {"a": [1, 2.5, True, None, "s", (3, 4)], 7: {"b": torch.zeros(2)}},
    "parameter": torch.nn.Parameter(torch.ones(2)),
    "torch_values": [torch.float32, torch.device("cpu"), torch.Size([2, 3])],
}
def nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


NOT_PLAIN = {  # case: (the value, made when the test runs; words of the sentence)
    "meta_tensor": (lambda: {"m": torch.empty(2, device="meta")}, ["['m']", "meta device"]),
    "sparse_tensor": (lambda: [torch.zeros(2, 2).to_sparse()], ["[0]", "sparse_coo"]),
    "nested_tensor": (lambda: {"n": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])}, ["nested tensor"]),
    "quantized_tensor": (lambda: {"q": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)},
                         ["quantized"]),
    "tensor_subclass": (lambda: {"t": Moment(torch.zeros(2))}, ["['t']", "Moment"]),
    "graph_tensor": (lambda: {"g": torch.ones(1, requires_grad=True) * 2}, ["autograd graph"]),
    "float_subclass": (lambda: {"lr": Rate(0.1)}, ["['lr']", "Rate"]),
    "dict_subclass": (lambda: {"d": Endless(a=1)}, ["['d']", "Endless"]),
    "tuple_key": (lambda: {(1, 2): 3}, ["key of type tuple"]),
    "function": (lambda: {"f": len}, ["builtin_function_or_method"]),
    "too_deep": (lambda: nested_lists(40), ["deeper"]),
}


@pytest.mark.parametrize("case", sorted(PLAIN))
def test_plain_data_passes(case):
    assert plain_problem(PLAIN[case]) is None


@pytest.mark.parametrize("case", sorted(NOT_PLAIN))
def test_what_is_not_plain_data_is_named_without_calling_it(case):
    make, words = NOT_PLAIN[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and quantized tensors say they are a prototype, or deprecated
        value = make()
    problem = plain_problem(value)
    assert problem is not None and all(word in problem for word in words), problem


def test_a_report_holds_numbers_and_the_memory_no_tensor():
    assert json_text({"x": torch.tensor(0.5), "y": [1, 2]}, tensors="scalars") == ('{"x": 0.5, "y": [1, 2]}', None)
    assert "3 elements" in json_text({"x": torch.zeros(3)}, tensors="scalars")[1]
    assert "is a tensor" in json_text({"x": torch.tensor(0.5)})[1]


def test_the_users_optimizer_state_is_reduced_to_what_it_can_go_on_from():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.state[model.weight]["f"] = len
    optimizer.param_groups[0]["lr"] = Rate(0.5)
    optimizer.param_groups[0]["hook"] = len
    state, left_out = plain_optimizer_state(optimizer.state_dict(), optimizer.defaults)
    assert sorted(state["state"]) == [1] and state["param_groups"][0]["lr"] == 0.01
    assert "hook" not in state["param_groups"][0] and plain_problem(state) is None
    assert len(left_out) == 3 and "state of parameter 0" in left_out[0]
    optimizer.load_state_dict(state)
    optimizer.step()  # the weight's state starts afresh
    assert int(optimizer.state[model.weight]["step"]) == 1 and int(optimizer.state[model.bias]["step"]) == 2


def raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:  # noqa: B036 - the test raises it to give it a traceback
        return caught


ORDINARY = {"runtime_error": RuntimeError("deliberate"), "key_error": KeyError("k"), "no_args": ValueError(),
            "two_args": OSError(2, "gone"), "number": ZeroDivisionError(3), "system_exit": SystemExit(3),
            "with_a_traceback": raised(RuntimeError("shape")), "keyboard_interrupt": KeyboardInterrupt()}


@pytest.mark.parametrize("case", sorted(ORDINARY))
def test_an_ordinary_failure_reads_as_str_would_write_it(case):
    error = ORDINARY[case]
    assert failure_message(error) == (str(error) if not isinstance(error, OSError) else repr(error.args))
    assert failure_text(error) == (f"{type(error).__name__}: {failure_message(error)}" if failure_message(error)
                                   else type(error).__name__)


def test_a_traceback_has_the_frames_the_standard_one_has():
    def inner():
        torch.zeros(2) @ torch.zeros(3)

    def outer():
        inner()

    error = raised_from(outer)
    standard = [line for line in traceback.format_exception(error, limit=-2) if line.startswith("  File")]
    ours = trace_of(error, -2)
    assert ours.startswith("Traceback (most recent call last):\n") and ours.endswith(failure_text(error) + "\n")
    assert [line for line in ours.splitlines(keepends=True) if line.startswith("  File")] == \
           [line.splitlines(keepends=True)[0] for line in standard]


def raised_from(fn) -> BaseException:
    try:
        fn()
    except BaseException as caught:  # noqa: B036 - the test wants the error with its traceback
        return caught
    raise AssertionError("it did not raise")


# -- a program's own state ---------------------------------------------------------------------------------------

STATES = {  # case: (what the program's state_dict() returns, words of the reverted event's message)
    "meta_tensor": ("{'m': torch.empty(2, device='meta')}", ["state_dict()", "['m']", "meta device"]),
    "sparse_tensor": ("{'s': torch.zeros(2, 2).to_sparse()}", ["state_dict()", "['s']", "sparse_coo tensor"]),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_a_program_state_torch_cannot_save_reverts_the_program_and_the_checkpoint_loads(opal, run_dir, tmp_path,
                                                                                       case):
    returned, words = STATES[case]
    updater = opal.sgd_updater().replace('        return {"count": self.count}', f"        return {returned}")
    model, optimizer = wrapped(opal, run_dir, updater)
    opal.train(model, optimizer, CHECKPOINT_AT)
    assert optimizer.current.number == 1
    read = checkpoint_then_go_on(opal, run_dir, tmp_path, model, optimizer)
    assert_reverted(opal, optimizer, run_dir, read, words)


# -- what a program leaves in the user's optimizer ------------------------------------------------------------------

CLASSES = '''
class Rate(float):
    pass


class Endless(dict):
    def items(self):
        while True:
            pass


class Moment(torch.Tensor):
    pass
'''
LEFT_IN_THE_OPTIMIZER = {  # case: (what build() does to spec.optimizer, words of the message)
    "function_in_a_parameters_state": ("spec.optimizer.state[first]['f'] = lambda: 1",
                                       ["state of parameter 0", "function", "starts afresh"]),
    "function_in_a_group": ("spec.optimizer.param_groups[0]['hook'] = lambda: 1", ["group setting 'hook'"]),
    "float_subclass_as_the_learning_rate": ("spec.optimizer.param_groups[0]['lr'] = Rate(0.5)",
                                            ["group setting 'lr'", "default"]),
    "dict_subclass_with_endless_items_as_a_state": (
        "spec.optimizer.state[first] = Endless(spec.optimizer.state[first])", ["state of parameter 0", "Endless"]),
    "tensor_subclass_as_a_moment": ("spec.optimizer.state[first]['exp_avg'] = Moment(torch.zeros(first.shape))",
                                    ["state of parameter 0", "Moment"]),
    "meta_tensor_as_a_moment": ("spec.optimizer.state[first]['exp_avg'] = torch.empty(first.shape, device='meta')",
                                ["state of parameter 0", "meta device"]),
}


@pytest.mark.parametrize("case", sorted(LEFT_IN_THE_OPTIMIZER))
def test_what_build_leaves_in_the_users_optimizer_reverts_the_program_and_the_optimizer_goes_on(opal, run_dir,
                                                                                               tmp_path, case):
    polluting, words = LEFT_IN_THE_OPTIMIZER[case]
    build_body = f"    first = spec.optimizer.param_groups[0]['params'][0]\n    {polluting}"
    updater = opal.sgd_updater(build_body=build_body).replace("import torch\n", "import torch\n" + CLASSES, 1)
    model, optimizer = wrapped(opal, run_dir, updater)
    with cpu_deadline():
        opal.train(model, optimizer, CHECKPOINT_AT)
    assert optimizer.current.number == 1
    read = checkpoint_then_go_on(opal, run_dir, tmp_path, model, optimizer)
    assert_reverted(opal, optimizer, run_dir, read, ["user's optimizer", *words])
    # the live optimizer holds only plain data again, and the learning rate is the user's (1e-2)
    base = optimizer.base
    assert all(type(value) in (torch.Tensor, int, float) for state in base.state.values() for value in state.values())
    assert type(base.param_groups[0]["lr"]) is float and base.param_groups[0]["lr"] == 1e-2
    assert "hook" not in base.param_groups[0]


# -- the analysis: its memory and its report ------------------------------------------------------------------------

ENDLESS = '''
class Endless(dict):
    def items(self):
        while True:
            pass


class Rate(float):
    pass

'''


def test_an_analysis_memory_whose_items_never_return_reverts_the_program_without_calling_it(opal, run_dir, tmp_path):
    analysis = ("EVERY = 5\n" + ENDLESS + "def analyze(obs, memory):\n    memory['trap'] = Endless(a=1)\n"
                "    return {'report': {'update': obs['update']}}\n")
    model, optimizer = wrapped(opal, run_dir, opal.sgd_updater(), analysis)
    opal.train(model, optimizer, CHECKPOINT_AT)
    assert optimizer.current.number == 1
    read = checkpoint_then_go_on(opal, run_dir, tmp_path, model, optimizer)
    assert_reverted(opal, optimizer, run_dir, read, ["analysis memory", "['trap']", "Endless", "cleared"])
    assert read["observer"]["memory"] == {}


REPORTS = {  # case: (the report, words of the message)
    "dict_subclass_with_endless_items": ("{'trap': Endless(a=1)}", ["report", "['trap']", "Endless"]),
    "float_subclass": ("{'rate': Rate(0.5)}", ["report", "['rate']", "Rate"]),
    "tensor_of_many_numbers": ("{'norms': torch.zeros(3)}", ["report", "['norms']", "3 elements"]),
}


@pytest.mark.parametrize("case", sorted(REPORTS))
def test_a_report_that_is_not_plain_data_reverts_the_program_when_it_is_made(opal, run_dir, tmp_path, case):
    report, words = REPORTS[case]
    analysis = ("import torch\n\nEVERY = 5\n" + ENDLESS + f"def analyze(obs, memory):\n    return {{'report': {report}}}\n")
    model, optimizer = wrapped(opal, run_dir, opal.sgd_updater(), analysis, step_time_limit=1.0)
    with cpu_deadline():
        opal.train(model, optimizer, CHECKPOINT_AT)
    reverted = events(opal, optimizer, run_dir, "reverted")
    assert [(e["version"], e["to"], e["update"]) for e in reverted] == [(1, 0, CHECKPOINT_AT)]  # its first analysis
    assert all(word in reverted[0]["message"] for word in words), reverted[0]["message"]
    assert optimizer.current.number == 0 and not events(opal, optimizer, run_dir, "analysis_failed")
    read = checkpoint_then_go_on(opal, run_dir, tmp_path, model, optimizer)
    assert read["current"] == 0


def test_a_one_element_tensor_in_a_report_is_written_as_its_number(opal, run_dir):
    analysis = "import torch\n\nEVERY = 5\ndef analyze(obs, memory):\n    return {'report': {'x': torch.tensor(0.5)}}\n"
    model, optimizer = wrapped(opal, run_dir, opal.sgd_updater(), analysis)
    opal.train(model, optimizer, CHECKPOINT_AT)
    assert optimizer.current.number == 1 and optimizer.latest_report == {"x": 0.5}


# -- exceptions whose text is a program's ---------------------------------------------------------------------------

ENDLESS_STR = '''
class Endless(Exception):
    def __str__(self):
        while True:
            pass


class Text:
    def __str__(self):
        while True:
            pass

'''
RAISES = {  # where: (the updater and analysis, the event it ends as, the version running at the end)
    "top_level": (lambda opal, error: (f"import torch\n{ENDLESS_STR}raise {error}\n" + opal.sgd_updater(), None),
                  "load_failed", 0),
    "step": (lambda opal, error: (opal.broken_updater(f"        raise {error}", imports="import torch\n" + ENDLESS_STR),
                                  None), "reverted", 0),
    "build": (lambda opal, error: (opal.sgd_updater(build_body=f"    raise {error}").replace(
        "import torch\n", "import torch\n" + ENDLESS_STR, 1), None), "load_failed", 0),
    "analyze": (lambda opal, error: (opal.sgd_updater(), f"EVERY = 5\n{ENDLESS_STR}\ndef analyze(obs, memory):\n"
                                                         f"    raise {error}\n"), "analysis_failed", 1),
    "state_dict": (lambda opal, error: (opal.sgd_updater().replace(
        '        return {"count": self.count}', f"        raise {error}").replace(
        "import torch\n", "import torch\n" + ENDLESS_STR, 1), None), "reverted", 0),
}
ERRORS = {"own_str": ("Endless()", "Endless"),
          "argument_with_its_own_str": ("RuntimeError(Text())", "(its arguments, of types Text, are not shown)")}


@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("where", sorted(RAISES))
def test_a_failure_whose_text_never_returns_is_written_without_calling_it(opal, run_dir, tmp_path, unchecked,
                                                                          where, error):
    raised, text = ERRORS[error]
    make, kind, running = RAISES[where]
    updater, analysis = make(opal, raised)
    model, optimizer = wrapped(opal, run_dir, updater, analysis)
    with cpu_deadline():
        opal.train(model, optimizer, CHECKPOINT_AT)
        optimizer.state_dict()
        opal.train(model, optimizer, STEPS - CHECKPOINT_AT, start=CHECKPOINT_AT)
    found = events(opal, optimizer, run_dir, kind)
    assert found and text in found[0]["message"], found
    assert optimizer.t == STEPS and optimizer.current.number == running


# -- the agent's dry run refuses what the run would revert -------------------------------------------------------

def test_the_dry_run_refuses_a_state_report_or_memory_the_run_would_revert(opal, tmp_path):
    from opalctl.opal.agents.dry_run import dry_run

    sources = opal.default_sources()
    facts = {"shapes": {"w": [[4, 3], "float32"]}, "lrs": [0.01]}
    cases = {
        "meta device": (opal.sgd_updater().replace('        return {"count": self.count}',
                                                   "        return {'m': torch.empty(2, device='meta')}"),
                        sources["analysis.py"]),
        "report that cannot be written": (sources["updater.py"], ENDLESS + "def analyze(obs, memory):\n"
                                                                           "    return {'report': {'r': Rate(1.0)}}\n"),
        "memory cannot be saved": (sources["updater.py"], ENDLESS + "def analyze(obs, memory):\n"
                                                                    "    memory['trap'] = Endless(a=1)\n"
                                                                    "    return {'report': {}}\n"),
    }
    for words, (updater, analysis) in cases.items():
        (tmp_path / "updater.py").write_text(updater)
        (tmp_path / "analysis.py").write_text(analysis)
        with cpu_deadline():
            problem = dry_run(tmp_path, facts, sources)
        assert problem is not None and words in problem, problem
