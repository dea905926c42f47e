"""Programs are checked statically before loading. File I/O, processes, sockets, eval/exec, dynamic imports
and reaching into other modules' globals are refused with a message the agent can act on (a rule enforced at load,
not a sandbox); ordinary numeric code is accepted."""

import pytest

from opalctl.opal.programs import ProgramRejected, check_source, load_program

REFUSED = {
    "open": ("f = open('x.txt', 'w')", "open"),
    "eval": ("y = eval('1 + 1')", "eval"),
    "exec": ("exec('y = 1')", "exec"),
    "compile": ("c = compile('1', 'x', 'eval')", "compile"),
    "__import__": ("m = __import__('os')", "__import__"),
    "import_os": ("import os", "'os'"),
    "import_sys": ("import sys", "'sys'"),
    "import_subprocess": ("import subprocess", "'subprocess'"),
    "import_socket": ("import socket", "'socket'"),
    "import_importlib": ("import importlib", "'importlib'"),
    "import_pathlib": ("import pathlib", "'pathlib'"),
    "import_os_path_dotted": ("import os.path", "'os.path'"),
    "from_os_import_path": ("from os import path", "'os'"),
    "relative_import": ("from . import x", "not allowed"),
    "star_import": ("from math import *", "'*'"),
    "torch_save": ("torch.save({}, 'x.pt')", ".save"),
    "torch_load": ("s = torch.load('x.pt')", ".load"),
    "torch_hub": ("m = torch.hub.load('a/b', 'c')", "hub"),
    "from_torch_import_save": ("from torch import save", "'save'"),
    "dunder_globals": ("def f(x):\n    return x.__globals__", "__globals__"),
    "dunder_class_subclasses": ("s = ().__class__.__subclasses__()", "__class__"),
    "getattr_dunder_literal": ("def f(x):\n    return getattr(x, '__dict__')", "literal attribute name"),
    "getattr_private_literal": ("def f(x):\n    return getattr(x, '_secret')", "literal attribute name"),
    "getattr_non_literal": ("def f(x, name):\n    return getattr(x, name)", "literal attribute name"),
    "hasattr_non_literal": ("def f(x, name):\n    return hasattr(x, name)", "literal attribute name"),
    "global_statement": ("n = 0\ndef f():\n    global n\n    n = 1", "global"),
    "globals_call": ("g = globals()", "globals"),
    "setattr": ("def f(x):\n    setattr(x, 'a', 1)", "setattr"),
    "torch_C": ("x = torch._C", "torch._C"),
    "torch_ops": ("x = torch.ops.aten", "torch.ops"),
    "torch_utils": ("x = torch.utils.data", "torch.utils"),
    "async": ("async def f():\n    pass", "async"),
    # issue 25: the allowlist's holes, each refused with its sentence
    "functools_wraps": ("import functools\ndef f():\n    pass\ng = functools.wraps(torch.is_tensor)(f)",
                        "functools.wraps is not allowed"),
    "from_functools_import_wraps": ("from functools import wraps", "functools.wraps is not allowed"),
    "dunder_string_in_a_keyword_tuple": ("x = dict(names=('__globals__',))", "names an interpreter internal"),
    "dunder_string_as_a_dict_key": ("x = {'__class__': 1}", "'__class__'"),
    "dunder_bytes": ("x = b'__dict__'", "'__dict__'"),
    "dunder_word_inside_a_string": ("x = 'a,__str__ b'", "holds '__str__'"),
    "dunder_template_for_format": ("x = '__{}__'.format('globals')", "template"),
    "dunder_template_for_percent": ("x = '__%s__' % 'globals'", "template"),
    "dunder_template_as_an_f_string": ("def f(n):\n    return f'__{n}__'", "template"),
    "frame_attribute_as_a_string": ("x = ['f_globals']", "'f_globals'"),
    "dunder_keyword_argument_name": ("x = dict(__globals__=1)", "keyword argument name"),
    "dunder_class_name": ("class __globals__:\n    pass", "class name"),
    "private_member_of_a_torch_class": ("x = torch.Tensor._make_subclass", "torch.Tensor._make_subclass"),
    "private_member_of_torch_nn_module": ("x = torch.nn.Module._apply", "torch.nn.Module._apply"),
    "inherited_private_member_on_self": ("class M(torch.nn.Module):\n    def m(self):\n        return self._apply(abs)",
                                         "never set or define _apply"),
    "self_rebound_by_walrus": ("class A:\n    def m(self, o):\n        if (self := o):\n            return self._secret",
                               "rebinding 'self'"),
    "self_rebound_by_a_for_loop": ("class A:\n    def m(self, o):\n        for self in [o]:\n"
                                   "            return self._secret", "rebinding 'self'"),
    "self_rebound_by_with_as": ("class A:\n    def m(self, o):\n        with o as self:\n            return self._secret",
                                "rebinding 'self'"),
    "self_rebound_by_except_as": ("class A:\n    def m(self):\n        try:\n            pass\n"
                                  "        except Exception as self:\n            self.args = ()", "rebinding 'self'"),
    "self_rebound_in_a_comprehension": ("class A:\n    def m(self, o):\n        return [self._secret for self in [o]]",
                                        "rebinding 'self'"),
    "self_rebound_by_a_nested_parameter": ("class A:\n    def m(self):\n        def inner(self):\n"
                                           "            return self._secret\n        return inner", "rebinding 'self'"),
    "self_rebound_by_a_lambda_parameter": ("class A:\n    def m(self):\n        return lambda self: self._secret",
                                           "rebinding 'self'"),
    "self_rebound_by_tuple_unpacking": ("class A:\n    def m(self, o):\n        self, n = o, 1\n"
                                        "        return self._secret", "rebinding 'self'"),
    "self_deleted": ("class A:\n    def m(self):\n        del self", "rebinding 'self'"),
    "self_rebound_by_def": ("class A:\n    def m(self):\n        def self():\n            pass\n        self.x = 1",
                            "rebinding 'self'"),
    "cls_rebound": ("class A:\n    @classmethod\n    def m(cls, o):\n        for cls in [o]:\n"
                    "            return cls._secret", "rebinding 'cls'"),
    "receiver_positional_only": ("class A:\n    def m(self, /, other):\n        other.step = None",
                                 "assigning or deleting other.step"),
    "method_rebound_as_a_staticmethod": ("class A:\n    def m(self, v):\n        self.step = v\n"
                                         "    m = staticmethod(m)", "rebinding the method 'm'"),
    "method_decorated_by_a_function_of_its_own": ("def deco(f):\n    return f\nclass A:\n    @deco\n"
                                                  "    def m(self):\n        self.n = 1", "may only be decorated"),
    "isinstance_rebound": ("def isinstance(a, b):\n    return b", "relies on"),
    "property_rebound": ("def property(f):\n    return f", "relies on"),
    "storage_type_with_a_module_name": ("def f(x):\n    return x.untyped_storage().type('os')",
                                        "takes only a dtype written out"),
    "tensor_type_with_a_variable": ("def f(x, d):\n    return x.type(d)", "x.to(dtype)"),
    "type_method_held_then_called": ("def f(x):\n    t = x.type\n    return t('os')",
                                     "may only be called where it is written"),
    "getattr_of_type": ("def f(x):\n    return getattr(x, 'type')('os')", "hides a call"),
    "format_held_then_called": ("def f(s, o):\n    g = s.format\n    return g(o)",
                                "may only be called where it is written"),
    "attribute_error_obj": ("def f(e):\n    return e.obj", "AttributeError's .obj"),
    "abc_register": ("import numbers\nnumbers.Real.register(float)", "isinstance() answers"),
    "get_device_module": ("m = torch.get_device_module('cpu')", "returns a module"),
    "default_generator": ("g = torch.default_generator", "global settings"),
    "enum_functional_api": ("import enum\nE = enum.Enum('E', {'a': 1})", "builds an Enum from data"),
    "enum_functional_api_of_a_subclass": ("from enum import Enum\nclass B(Enum):\n    pass\nE = B('E', 'a b')",
                                          "builds an Enum from data"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(case):
    code, words = REFUSED[case]
    source = "import torch\n\n" + code + "\n"
    problems = check_source(source, "v001/updater.py")
    assert problems, f"{case} should be refused"
    assert any(words in p for p in problems), problems
    assert all(p.startswith("v001/updater.py line ") for p in problems)  # each names the file and line
    with pytest.raises(ProgramRejected) as raised:
        load_program("updater", source, label="v001/updater")
    assert words in str(raised.value)


def test_the_problem_names_the_line():
    problems = check_source("import math\n\n\nx = eval('2')\n", "u.py")
    assert problems == ["u.py line 4: eval: eval is not allowed; write the code out"]


def test_every_problem_is_listed():
    problems = check_source("import os\nimport socket\nopen('x')\n", "u.py")
    assert [p.split(":")[0] for p in problems] == ["u.py line 1", "u.py line 2", "u.py line 3"]


def test_a_syntax_error_is_a_problem_not_an_exception():
    problems = check_source("def f(:\n", "u.py")
    assert len(problems) == 1 and "syntax error" in problems[0] and "line 1" in problems[0]


ACCEPTED = {
    "import_math": "import math\ny = math.sqrt(2.0)",
    "functional": "import torch.nn.functional as F\ny = F.relu(torch.zeros(2))",
    "clip_grad_norm": "def f(ps):\n    return torch.nn.utils.clip_grad_norm_(ps, 1.0)",
    "from_torch_import": "from torch import nn\nfrom collections import OrderedDict, deque",
    "getattr_literal": "def f(x):\n    return getattr(x, 'lr', None)",
    "init_and_name": "class A:\n    def __init__(self):\n        self.n = type(self).__name__",
    "state_dict_work": ("def f(opt):\n    s = opt.state_dict()\n    opt.load_state_dict(s)\n"
                        "    return {k: v for k, v in s.items()}"),
    "loops_and_comprehensions": "xs = [i * i for i in range(3) if i]\nwhile False:\n    pass",
    "tensor_type_with_a_dtype": "def f(x):\n    return x.type(torch.float32), x.type(), x.device.type == 'cuda'",
    "own_private_methods_and_constants": ("class A:\n    _SCALE = 2\n    def _twice(self, v):\n"
                                          "        return v * self._SCALE\n    def m(self, v):\n"
                                          "        return self._twice(v)"),
    "property_with_a_setter": ("class A:\n    @property\n    def lr(self):\n        return self._lr\n"
                               "    @lr.setter\n    def lr(self, v):\n        self._lr = v"),
    "method_decorators": ("import functools\nclass A:\n    @torch.no_grad()\n    def step(self, p):\n"
                          "        p.mul_(0.5)\n    @functools.cached_property\n    def size(self):\n        return 1"),
    "a_nested_class_has_its_own_self": ("class A:\n    def m(self):\n        class B:\n            def n(self):\n"
                                        "                self.x = 1\n        return B()"),
    "enum_class_statement": "from enum import Enum\nclass Phase(Enum):\n    WARMUP = 1\n    DECAY = 2\nx = Phase(1)",
    "text_and_keys": "memory = {'_count': 0, 'f_score': 1.0}\nnote = f'spike: {1.0:.3g} ____ 100%'",
    "docstring_prose": "def f():\n    \"\"\"Reads nothing through __class__ or f_back.\"\"\"\n    return 1",
    "namedtuple": "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')",
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted(case):
    source = "import torch\n\n" + ACCEPTED[case] + "\n"
    assert check_source(source, "u.py") == []


def test_state_dict_methods_are_not_mistaken_for_torch_load(opal):
    """``load_state_dict`` is an ordinary method; only the attribute ``load`` itself is refused."""
    assert check_source("def f(o, s):\n    o.load_state_dict(s)\n", "u.py") == []


@pytest.mark.parametrize("name", ["updater.py", "analysis.py"])
def test_the_default_programs_pass_and_load(opal, name):
    source = opal.default_sources()[name]
    assert check_source(source, name) == []
    program = load_program(name[:-3], source, label=f"v000/{name[:-3]}")
    assert callable(getattr(program.module, "build" if name == "updater.py" else "analyze"))


def test_programs_load_as_private_modules(opal):
    import sys

    source = "import torch\nCOUNT = [0]\n"
    first = load_program("updater", source, label="v001/updater")
    second = load_program("updater", source, label="v002/updater")
    first.module.COUNT[0] += 1
    assert second.module.COUNT == [0]  # two versions never share state
    assert first.module.__name__ not in sys.modules
    assert all(m is not first.module for m in sys.modules.values())


def test_top_level_failure_is_a_rejection():
    with pytest.raises(ProgramRejected, match="failed while loading: ZeroDivisionError"):
        load_program("updater", "x = 1 / 0\n", label="v001/updater")


# Gaps: each reaches what the check means to refuse by a route the check does not look at.
GAPS = {
    "getattr_literal_forbidden_attribute": (
        "getattr(torch, 'save')({}, 'x.pt')",
        "getattr() with a literal name is only checked for a leading '_', not against FORBIDDEN_ATTRIBUTES"),
    "from_torch_hub_import": (
        "from torch.hub import load_state_dict_from_url",
        "'from torch.hub import NAME' passes: the module path of an ImportFrom is not checked against "
        "FORBIDDEN_ATTRIBUTES (hub), only the imported names"),
    "import_torch_hub_as": (
        "import torch.hub as h\nh.download_url_to_file('http://x', 'y')",
        "'import torch.hub as h' passes (only the root 'torch' is checked), and h.download_url_to_file is not refused"),
    "from_cpp_extension_import": (
        "from torch.utils.cpp_extension import load_inline",
        "'from torch.utils.cpp_extension import load_inline' passes (compiles and loads native code)"),
    "builtins_name": (
        "__builtins__['open']('x.txt', 'w')",
        "the name __builtins__ is not refused (only dunder attributes are); __builtins__['open'] reaches open"),
}


@pytest.mark.parametrize("case", sorted(GAPS))
def test_refused_gaps(case):
    assert check_source("import torch\n\n" + GAPS[case][0] + "\n", "u.py")
