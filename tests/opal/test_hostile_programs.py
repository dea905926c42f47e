"""Programs written as a hostile agent would write them: each way past the static check is refused before any of
the program's code runs, every exception a program raises is its failure (a real Ctrl-C still stops training),
what ``state_dict``/``load_state_dict`` do is checked when they run, torch's global state comes back after each
call, and a program that hangs past its limit ends the process with a record (exit 4) and never runs again."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from opalctl.errors import EXIT_PROGRAM_HUNG
from opalctl.opal import wrap
from opalctl.opal.guard import StepGuard, contained
from opalctl.opal.programs import ProgramRejected, check_program, check_source, read_program_file

STEPS = 40
AT = 0.125  # the decision falls before update 5
ROOT = Path(__file__).resolve().parents[2]

# -- the static check: each route of the issue into what a program must not reach ---------------------------------
BYPASSES = {
    "torch_builtins_open": "torch.builtins.open('x', 'w')",
    "torch_builtins_exec": "torch.builtins.exec('y = 1')",
    "torch_os_open": "torch.os.open('x', 0)",
    "torch_os_posix_spawn": "torch.os.posix_spawn('/bin/true', [], {})",
    "torch_os_exit_in_step": "def step(grads, update, ctx):\n    torch.os._exit(0)",
    "torch_importlib": "torch.importlib.import_module('subprocess')",
    "alias_of_torch_sys": "s = torch.sys\ns.modules['os']",
    "import_torch_as_alias_C": "import torch as T\nx = T._C",
    "typing_sys": "import typing\nx = typing.sys",
    "dataclasses_builtins": "import dataclasses\ndataclasses.builtins.open('x')",
    "torch_serialization_pickle": "torch.serialization.pickle.loads(b'')",
    "torch_ctypes": "torch.ctypes.CDLL(None)",
    "numpy_through_functional": "torch.nn.functional.np.savetxt('x', [1])",
    "frame_of_the_caller": "def step(grads, update, ctx):\n    return torch.sys._getframe(1).f_locals['self']",
    "environment": "key = torch.os.environ['ANTHROPIC_API_KEY']",
    "patch_tensor_sum": "torch.Tensor.sum = lambda *args, **kwargs: torch.zeros(())",
    "patch_adamw_step": "torch.optim.AdamW.step = lambda self, closure=None: None",
    "patch_linear_forward": "from torch import nn\nnn.Linear.forward = lambda self, x: x",
    "patch_through_an_alias": "T = torch.Tensor\nT.sum = None",
    "patch_by_del": "del torch.Tensor.sum",
    "patch_by_augmented_assignment": "torch.Tensor.x += 1",
    "patch_through_type": "def f(x):\n    type(x).sum = None",
    "patch_through_an_argument": "def f(cls):\n    cls.sum = None\nf(torch.Tensor)",
    "patch_through_an_unbound_method": "class A:\n    def m(self):\n        self.sum = None\nA.m(torch.Tensor)",
    "patch_by_rebinding_self": "class A:\n    def m(self):\n        self = torch.Tensor\n        self.sum = None",
    "module_as_an_argument": "def f(m):\n    return m.os\nf(torch)",
    "module_as_a_default": "def f(m=torch):\n    return m.os",
    "module_in_a_comprehension": "xs = [m.os for m in [torch]]",
    "getattr_as_a_value": "import functools\nx = functools.reduce(getattr, ['os'], torch)",
    "attrgetter": "import operator\nf = operator.attrgetter('os')",
    "format_reaches_an_attribute": "x = '{0.__class__}'.format(1)",
    "format_on_a_variable": "f = '{0.os}'\nx = f.format(torch)",
    "tensor_hook": "def f(p):\n    p.register_hook(lambda g: g * 0)",
    "global_forward_hook": "from torch.nn.modules.module import register_module_forward_hook",
    "autograd_graph": "x = torch.autograd.graph",
    "set_num_threads": "torch.set_num_threads(2)",
    "set_default_dtype": "torch.set_default_dtype(torch.float64)",
    "manual_seed": "torch.manual_seed(0)",
    "generator_frame": "def g():\n    yield 1\nx = g().gi_frame.f_back",
    "own_dunder_str": "class E(Exception):\n    def __str__(self):\n        return 'x'",
    "builtin_outside_the_allowlist": "m = memoryview(b'')",
    "private_attribute_of_an_argument": "def f(spec):\n    return spec._params",
}


@pytest.mark.parametrize("case", sorted(BYPASSES))
def test_each_way_around_the_static_check_is_refused_with_a_sentence(case):
    problems = check_source("import torch\n\n" + BYPASSES[case] + "\n", "v001/updater.py")
    assert problems, f"{case} must be refused"
    assert all(p.startswith("v001/updater.py line ") for p in problems)


# issue 25: the two lines that passed the check and made torch's module globals (os, sys, builtins, importlib,
# ctypes) plain names of the program
WRAPS_BYPASS = ("def f():\n    pass\n"
                "functools.wraps(torch.is_tensor, assigned=(), updated=(\"__globals__\",))(f)\n")


def test_the_wraps_bypass_of_the_security_review_is_refused_with_a_sentence():
    namespace: dict = {}
    exec(compile("import functools\nimport torch\n" + WRAPS_BYPASS, "bypass", "exec"), namespace)
    assert namespace["os"] is os and namespace["sys"] is sys  # what the two lines do to a program's globals

    source = "import functools\nimport torch\n\n" + WRAPS_BYPASS + "os.execv('/bin/sh', ['sh'])\n"
    problems = check_source(source, "v001/updater.py")
    assert any("functools.wraps is not allowed: it copies attributes named as data" in p for p in problems), problems
    assert any("'__globals__' names an interpreter internal" in p for p in problems), problems
    with pytest.raises(ProgramRejected, match="functools.wraps is not allowed"):
        check_program("updater", source, label="v001/updater")


HONEST = {
    "tensor_data_and_grad": "def f(p):\n    p.data = p.data.float()\n    p.grad = None",
    "own_state": "class U:\n    def __init__(self):\n        self._n = 0\n        self.buf = {}\n"
                 "    def step(self):\n        self._n += 1",
    "isinstance_of_torch_classes": "x = isinstance(1, (torch.Tensor, int))",
    "no_grad_decorator": "@torch.no_grad()\ndef f(p):\n    p.mul_(0.5)",
    "foreach": "def f(ps):\n    return torch._foreach_norm(ps)",
    "set_grad_enabled_block": "def f(p):\n    with torch.set_grad_enabled(False):\n        return p * 2",
    "own_generator": "g = torch.Generator().manual_seed(0)\nx = torch.randn(3, generator=g)",
}


@pytest.mark.parametrize("case", sorted(HONEST))
def test_what_honest_programs_write_passes(case):
    assert check_source("import torch\n\n" + HONEST[case] + "\n", "u.py") == []


# -- running programs ------------------------------------------------------------------------------------------------

def run_with(opal, run_dir, updater=None, analysis=None, *, steps=STEPS, every=None, **options):
    model = opal.make_model()
    if analysis is not None and every is not None:
        analysis = f"EVERY = {every}\n" + analysis
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=updater, analysis=analysis), decisions=1,
                     schedule=[AT], total_steps=steps, run_dir=run_dir, **options)
    opal.train(model, optimizer, steps)
    optimizer.close()
    assert optimizer.t == steps
    return model, optimizer, opal.events(run_dir)


def test_a_program_that_patches_tensor_sum_is_refused_and_nothing_of_it_ran(opal, run_dir):
    source = "import torch\n\ntorch.Tensor.sum = lambda *args, **kwargs: torch.zeros(())\n" + opal.sgd_updater()
    original = torch.Tensor.sum
    model, optimizer, log = run_with(opal, run_dir, source)
    assert torch.Tensor.sum is original
    assert "torch.Tensor.sum" in opal.of_kind(log, "load_failed")[0]["message"]
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def test_a_refused_analysis_keeps_the_updaters_top_level_from_running(opal, run_dir):
    # on the old order the updater's top level ran first, and its SystemExit ended training
    updater = "raise SystemExit(3)\n" + opal.sgd_updater()
    analysis = opal.default_sources()["analysis.py"] + "\nimport os\n"
    model, optimizer, log = run_with(opal, run_dir, updater, analysis)
    message = opal.of_kind(log, "load_failed")[0]["message"]
    assert "analysis.py" in message and "'os'" in message and "SystemExit" not in message


EXCEPTIONS = ("KeyboardInterrupt", "GeneratorExit", "SystemExit")


@pytest.mark.parametrize("error", EXCEPTIONS)
@pytest.mark.parametrize("where", ["top level", "build", "step", "analyze"])
def test_every_exception_a_program_raises_is_its_failure(opal, run_dir, error, where):
    raising = f"raise {error}()"
    updater, analysis = opal.sgd_updater(), None
    if where == "top level":
        updater = raising + "\n" + updater
    elif where == "build":
        updater = opal.sgd_updater(build_body="    " + raising)
    elif where == "step":
        updater = opal.broken_updater("        " + raising)
    else:
        analysis = f"def analyze(obs, memory):\n    {raising}\n"
    model, optimizer, log = run_with(opal, run_dir, updater, analysis, every=5)
    kinds = {"top level": "load_failed", "build": "load_failed", "step": "reverted", "analyze": "analysis_failed"}
    found = opal.of_kind(log, kinds[where])
    assert found and error in found[0]["message"], log
    assert opal.of_kind(log, "end")  # training went on to its end


def test_a_real_ctrl_c_still_stops_training_even_when_the_program_swallows_it(opal):
    model = opal.make_model()
    wrap(opal.adamw(model), model, backend="keep", total_steps=1)  # installs the SIGINT handler

    def swallowing():
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: B036 - what a hostile program does
            pass
        return "swallowed"

    with pytest.raises(KeyboardInterrupt):
        contained(swallowing)


STATE_DICTS = {
    "returns_a_lambda": "        return {'f': lambda: 1}",
    "raises": "        raise RuntimeError('no state')",
    "returns_a_graph_tensor": "        return {'t': torch.ones(1, requires_grad=True) * 2}",
}


@pytest.mark.parametrize("case", sorted(STATE_DICTS))
def test_a_state_dict_that_cannot_be_saved_fails_when_it_is_taken(opal, run_dir, case):
    source = opal.sgd_updater().replace('        return {"count": self.count}', STATE_DICTS[case])
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=source), decisions=1, schedule=[AT],
                     total_steps=STEPS, run_dir=run_dir, trial_steps=2)
    opal.train(model, optimizer, 10)
    assert optimizer.current.number == 1
    state = optimizer.state_dict()
    assert optimizer.current.number == 0 and state["current"] == 0
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # the checkpoint round-trips
    reverted = opal.of_kind(optimizer_events(optimizer, run_dir, opal), "reverted")
    assert reverted and "state_dict()" in reverted[-1]["message"]


def optimizer_events(optimizer, run_dir, opal):
    optimizer.records.flush()
    return opal.events(run_dir)


def test_a_load_state_dict_that_raises_at_resume_hands_over_to_the_fallback(opal, run_dir, tmp_path):
    source = opal.sgd_updater().replace("        self.count = int(state[\"count\"])",
                                        "        raise RuntimeError('cannot resume')")
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=source), decisions=1, schedule=[AT],
                     total_steps=STEPS, run_dir=run_dir, trial_steps=2)
    opal.train(model, optimizer, 10)
    state = optimizer.state_dict()
    assert state["current"] == 1
    resumed = wrap(opal.adamw(model), model, backend=opal.Writer(), decisions=1, schedule=[AT], total_steps=STEPS,
                   run_dir=run_dir)
    resumed.load_state_dict(state)
    assert resumed.current.number == 0
    log = optimizer_events(resumed, run_dir, opal)
    reverted = opal.of_kind(log, "reverted")
    assert reverted[-1]["reason"] == "resume" and "cannot resume" in reverted[-1]["message"]
    opal.train(model, resumed, STEPS - 10, start=10)  # and training goes on


def test_grad_mode_switched_off_at_top_level_comes_back_and_is_recorded(opal, run_dir):
    source = "import torch\n\ntorch.set_grad_enabled(False)\n" + opal.sgd_updater()
    model, optimizer, log = run_with(opal, run_dir, source)
    assert torch.is_grad_enabled()
    changed = [e for e in opal.of_kind(log, "log") if "torch_state_restored" in e["values"]]
    assert changed and changed[0]["values"]["torch_state_restored"] == ["grad mode"]


def test_a_step_that_draws_from_the_global_generator_leaves_it_as_it_was(opal, run_dir):
    source = opal.sgd_updater(body="        noise = torch.randn(3)")
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=source), decisions=1, schedule=[AT],
                     total_steps=STEPS, run_dir=run_dir)
    opal.train(model, optimizer, 10)
    assert optimizer.current.number == 1
    before = torch.get_rng_state()
    model(opal.DATA[0][0]).sum().backward()
    optimizer.step()
    assert torch.equal(torch.get_rng_state(), before)
    log = optimizer_events(optimizer, run_dir, opal)
    assert any(e["values"].get("torch_state_restored") == ["global random generator"] for e in opal.of_kind(log, "log"))


def test_threads_and_default_dtype_come_back_after_any_program_call():
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    guard = StepGuard(1.0, {})

    def meddle():
        torch.set_num_threads(threads + 1)
        torch.set_default_dtype(torch.float64)

    assert guard.call(None, "build()", meddle) == (None, None)
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == dtype
    assert guard.changes == [(None, "build()", ["number of threads", "default dtype"])]


def test_updater_files_that_are_not_utf8_or_are_folders_are_refused_with_a_sentence(tmp_path):
    (tmp_path / "updater.py").write_bytes(b"x = '\xff'\n")
    with pytest.raises(ProgramRejected, match=r"not valid UTF-8 text \(byte 0xff at offset 5\)"):
        check_program("updater", read_program_file(tmp_path / "updater.py"), label="v001/updater")
    (tmp_path / "analysis.py").mkdir()
    with pytest.raises(ProgramRejected, match="analysis.py is not a file"):
        check_program("analysis", read_program_file(tmp_path / "analysis.py"), label="v001/analysis")
    assert read_program_file(tmp_path / "missing.py") == ""


# -- hangs: the process ends with a record; the version never runs again -----------------------------------------

SWALLOW = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
HANGS = {  # case: (the code that hangs, the call the records name)
    "top_level": (SWALLOW, "the top level of a program"),
    "build": (SWALLOW, "build()"),
    "step": (SWALLOW, "step()"),
    "analyze": ("def analyze(obs, memory):\n" + textwrap.indent(SWALLOW, "    "), "analyze()"),
}
HANG_SCRIPT = '''
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import Opal as opal
from opalctl.opal import wrap

updater, analysis = {updater!r}, {analysis!r}
model = opal.make_model()
optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=updater, analysis=analysis), decisions=1,
                 schedule=[{at!r}], total_steps={steps}, run_dir=Path({run_dir!r}), step_time_limit=0.3)
opal.train(model, optimizer, {steps})
optimizer.close()
'''


def hang_sources(opal, case):
    """The updater and analysis of each hang: the code that hangs where the case says, the rest plain."""
    code = HANGS[case][0]
    if case == "top_level":
        return code + opal.sgd_updater(), None
    if case == "build":
        return opal.sgd_updater(build_body=textwrap.indent(code, "    ")), None
    if case == "step":
        return opal.broken_updater(textwrap.indent(code, "        ")), None
    return opal.sgd_updater(), "EVERY = 5\n\n" + code


@pytest.mark.parametrize("case", sorted(HANGS))
def test_a_program_that_hangs_and_swallows_the_interrupt_ends_the_process_with_a_record(opal, tmp_path, case):
    updater, analysis = hang_sources(opal, case)
    run_dir = tmp_path / "opal"
    script = HANG_SCRIPT.format(tests=str(ROOT / "tests" / "opal"), updater=updater, analysis=analysis, at=AT,
                                steps=STEPS, run_dir=str(run_dir))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == EXIT_PROGRAM_HUNG, done.stderr
    assert "v001 hung in " + HANGS[case][1] in done.stderr and "did not stop" in done.stderr
    hung = [json.loads(line) for line in (run_dir / "hung.jsonl").read_text().splitlines()]
    assert [(h["version"], h["call"]) for h in hung] == [(1, HANGS[case][1])]
    reverted = opal.of_kind(opal.events(run_dir), "reverted")
    assert reverted[-1]["reason"] == "hung" and reverted[-1]["version"] == 1

    # the same folder never loads those programs again: the agent proposing them again is refused
    model, optimizer, log = run_with(opal, run_dir, updater, analysis)
    failed = opal.of_kind(log, "load_failed")
    assert failed and "hung in an earlier run" in failed[-1]["message"]
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []
