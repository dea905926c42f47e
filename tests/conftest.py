"""Shared fixtures and hooks: one built-in digits project per test session, copies of it per test, finished runs.

``opalctl init digits`` trains a parent per seed, which is the slow part (a few seconds), so it runs once per
session (once per xdist worker) into a folder that no test touches; ``digits_project`` hands each test its own
copy to break as it likes. What tests share beyond fixtures (the CLI runners, building runs, reading folders) is in
the importable ``tests.support`` package.
``finished_runs`` is one frozen protocol's finished runs (five arms by two seeds), made once per session for
every worker, which compare, the report page and export read (tests that edit runs copy them first). ``sshd`` is a
real OpenSSH server on loopback with its own keys and an ssh config file naming it (``LoopbackSshd``).

A test that needs a system component (Landlock, chromium, Slurm, ...) skips with a reason that starts with
``SYSTEM_SKIP`` where the component is missing (a user's laptop). CI installs every such component and sets
``OPALCTL_REQUIRE_SYSTEM=1``, under which such a skip is a failure: CI never passes by skipping them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.files import SEEDS, SYSTEM_SKIP, sha256_of

# The modules whose tests start real runs, grids or browsers, or train through Hugging Face's Trainer or Lightning
# (whose imports alone take seconds in every worker that collects them), and take most of the suite's time: marked
# ``slow``, so that ``make test-fast`` (``-m "not slow"``) is the quick lane while working; ``make test`` runs
# everything. A lone heavy test in a quick module (a second whole prepare of a task's data) is marked
# ``@pytest.mark.slow`` where it stands.
# Listed heaviest first (CPU seconds, or wall for those that mostly wait, as measured by a whole run): the tests are
# handed to the xdist workers module by module in this order, then the fast modules, so that the last modules to
# start are small ones and the workers finish together (the Makefile passes --no-loadscope-reorder, which would
# otherwise order modules by their number of tests and leave a long two-test module such as Slurm's to the end).
SLOW_MODULES = (
    "compare/test_controls_nanogpt.py", "driver/test_agent_never_acted.py", "driver/test_agent_arm.py",
    "tasks/test_shapes_runs.py", "suite/test_suite_run.py", "tasks/test_task_runs.py", "suite/test_shipped_suite.py",
    "driver/test_mailbox_run.py", "driver/test_signals.py", "driver/test_crash_resume.py",
    "driver/test_verdict_holds.py", "opal/test_anthropic.py", "driver/test_agent_hang.py", "grid/test_slurm_grid.py",
    "driver/test_torchrun_run.py", "driver/test_task_failures.py", "driver/test_agent_unsaveable.py",
    "report/test_page.py", "grid/test_local_grid.py", "driver/test_diverging_run.py", "driver/test_evaluator.py",
    "driver/test_run.py", "driver/test_nanogpt_recipe.py", "report/test_pictures.py", "driver/test_learning_rates.py",
    "driver/test_run_folder.py", "integrations/test_hf.py", "driver/test_notes.py", "report/test_export_trackers.py",
    "test_write_faults.py", "test_watch.py", "driver/test_evaluator_dies_with_its_run.py", "grid/test_grid_ranks.py",
    "opal/test_prompt_edit.py", "grid/test_concurrent_grids.py", "driver/test_agent_keys.py",
    "driver/test_confined_run.py", "driver/test_agent_code_charge.py", "opal/test_replay.py",
    "distributed/test_ddp.py", "driver/test_storage_faults.py", "driver/test_compare_flags.py",
    "grid/test_readers_race.py", "driver/test_record_shapes.py", "integrations/test_lightning.py",
    "opal/test_claude_code.py",
)


def pytest_ignore_collect(collection_path, config):
    """Under ``-m "not slow"`` (``make test-fast``) a slow module is not even imported: collecting it would only
    import what it needs (mlflow, wandb, ...) in every worker for tests that are then deselected."""
    if config.getoption("markexpr", "").strip() == "not slow":
        tests = Path(__file__).resolve().parent
        path = Path(collection_path).resolve()
        if path.is_relative_to(tests) and path.relative_to(tests).as_posix() in SLOW_MODULES:
            return True
    return None


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    rank = {module: place for place, module in enumerate(SLOW_MODULES)}
    modules = {}
    for item in items:
        module = modules[item] = Path(item.fspath).resolve().relative_to(tests).as_posix()
        if module in rank:
            item.add_marker(pytest.mark.slow)
    # stable: the tests of one module keep their order
    items.sort(key=lambda item: rank.get(modules[item], len(SLOW_MODULES)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("OPALCTL_REQUIRE_SYSTEM") == "1" and SYSTEM_SKIP in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"skipped under OPALCTL_REQUIRE_SYSTEM=1 (CI must run it): {report.longrepr}"


@pytest.fixture(scope="session")
def digits_init_folder(made_once) -> Path:
    """``init("digits", folder, seeds=[1, 2])`` once per session, shared by the xdist workers (``made_once``);
    read-only for tests (copy it to change it)."""
    from opalctl.tasks.builtin import init

    return made_once("opalctl-digits-init", lambda folder: init("digits", folder / "project", seeds=list(SEEDS))) \
        / "project"


@pytest.fixture
def digits_project(digits_init_folder, tmp_path) -> Path:
    """A private copy of the initialised digits project at ``tmp_path / "project"``."""
    target = tmp_path / "project"
    shutil.copytree(digits_init_folder, target)
    return target


# Finished runs that compare, report and export read -----------------------------------------------------------

FINISHED_ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},
                 "agent": {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
                           "agent": {"backend": "heuristic", "decisions": 4}},
                 "high": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}},
                 "twin": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},  # the baseline's twin: ties on every seed
                 "still": {"optimizer": {"name": "AdamW", "lr": 1.0e-12}},  # learns nothing: keeps the anchor
                 "idle": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}}  # never run
FINISHED_POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
                   "improve_any": ["selection.correct"]}
FINISHED_UPDATES = 60


def _finish_runs(template: Path, root: Path) -> None:
    """Freeze the digits protocol with ``FINISHED_ARMS`` and run every arm but ``idle`` on both seeds."""
    from opalctl.driver.run import run
    from opalctl.protocol.freeze import freeze

    project = root / "project"
    shutil.copytree(template, project, ignore=shutil.ignore_patterns(".complete"))
    protocol = yaml.safe_load((project / "digits.yaml").read_text())
    protocol.update(budget={"clock": "updates", "amount": FINISHED_UPDATES, "threads": 1}, arms=FINISHED_ARMS,
                    selection=FINISHED_POLICY)
    (project / "digits.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False))
    lock = Path(freeze(project / "digits.yaml", force=True)["lock"])
    for arm in FINISHED_ARMS:
        if arm != "idle":
            for seed in SEEDS:
                run(lock, arm, seed, runs_dir=root / "runs")


@pytest.fixture(scope="session", autouse=True)
def stop_signals_not_ignored():
    """SIGINT, SIGTERM and SIGHUP at their usual action in the test processes and so in their children: a suite
    started under ``nohup`` inherits SIGHUP ignored, and one started in the background by a script SIGINT, and a
    run rightly leaves an ignored signal ignored (``StopSignals``, the agent's guard), which is not what the tests
    of stopping are about."""
    usual = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
    previous = {number: signal.signal(number, handler) for number, handler in usual.items()
                if signal.getsignal(number) == signal.SIG_IGN}
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


def _opalctl_namespaces() -> dict[str, dict[str, object]]:
    """A copy of the namespace of every opalctl module imported so far."""
    return {name: dict(vars(module)) for name, module in list(sys.modules.items())
            if module is not None and (name == "opalctl" or name.startswith("opalctl."))}


_ABSENT = object()


def _replaced(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> list[str]:
    """``module.name`` of each function or class of ``before`` that is another object in ``after``, and of each
    callable that is new in ``after`` and not a module (``opalctl.opal.wrap``, which the package gives lazily, set
    by hand)."""
    found = []
    for module, then in before.items():
        for name, value in after.get(module, {}).items():
            old = then.get(name, _ABSENT)
            if old is _ABSENT:
                if callable(value) and not isinstance(value, types.ModuleType):
                    found.append(f"{module}.{name}")
            elif old is not value and isinstance(old, (types.FunctionType, type)):
                found.append(f"{module}.{name}")
    return sorted(found)


@pytest.fixture(scope="module", autouse=True)
def no_opalctl_function_replaced():
    """A test module leaves every function and class of opalctl as it found it (``monkeypatch`` puts its own back
    before this looks). A replacement that outlives its module changes the later modules of that pytest worker: a
    task module that set ``opalctl.opal.wrap`` to a 0.5 s step limit, imported in-process by freeze, once failed
    another module's test whose program takes 0.6 s, in one worker of three, depending on the order. (Per module,
    not per test: the look takes milliseconds.)"""
    before = _opalctl_namespaces()
    yield
    replaced = _replaced(before, _opalctl_namespaces())
    assert not replaced, f"this module's tests replaced {', '.join(replaced[:5])} for the rest of the worker"


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """``made_once(name, make)``: the folder ``name``, made by ``make(folder)`` once per test session and shared
    by the xdist workers through a file lock (a folder without its ``.complete`` mark is made again); read-only."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by every worker of this session

    def folder_of(name: str, make) -> Path:
        folder = base / name
        with open(base / f"{name}.lock", "w") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            if not (folder / ".complete").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                (folder / ".complete").write_text("ok\n")
        return folder

    return folder_of


@pytest.fixture(scope="session")
def finished_runs(request, made_once) -> dict[str, Path]:
    """One frozen digits protocol (``FINISHED_ARMS``, 60 updates) whose arms but ``idle`` ran on seeds 1 and 2:
    ``lock``, ``runs``, ``base`` (the lock's folder under ``runs``), ``project``, ``root``. Made once per test
    session (``made_once``), so it is read-only: a test that edits runs copies ``runs`` into its own ``tmp_path``
    first."""
    root = made_once("opalctl-finished-runs",
                     lambda folder: _finish_runs(request.getfixturevalue("digits_init_folder"), folder))
    lock = next((root / "project").glob("digits*.lock.json"))
    return {"lock": lock, "runs": root / "runs", "base": root / "runs" / f"digits-{sha256_of(lock)[:12]}",
            "project": root / "project", "root": root}


# A real sshd on loopback -------------------------------------------------------------------------------------------

SSHD_ALIAS = "opalctl-loopback"


@dataclass
class LoopbackSshd:
    """An OpenSSH server on 127.0.0.1 (its own host key, one client key, no password login) and the ssh config file
    that reaches it as ``host`` (``ssh -F config host``): pass ``config`` to ``SshMailboxFolder`` or set it as
    ``OPALCTL_SSH_CONFIG`` for a subprocess."""

    config: Path
    host: str
    port: int
    folder: Path
    process: subprocess.Popen

    def target(self, directory: str | os.PathLike) -> str:
        """``HOST:DIR`` for a mailbox in ``directory`` on this server."""
        return f"{self.host}:{directory}"

    @property
    def log(self) -> str:
        return (self.folder / "sshd.log").read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_loopback_sshd(folder: Path) -> LoopbackSshd:
    """Start sshd in ``folder`` (its keys, sshd_config, ssh_config, known_hosts and log); ready when a login works.
    Skips with a ``SYSTEM_SKIP`` reason where openssh-server or the ssh client is missing."""
    sshd = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)),
                                        None)
    if sshd is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip(f"{SYSTEM_SKIP} sshd and ssh (Debian's openssh-server and openssh-client) are not installed")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(folder / name)],
                       check=True, capture_output=True)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder (Debian's unit makes it)
    for _attempt in range(3):  # a port another process took between the probe and sshd's bind: another port
        server = _start_sshd(sshd, folder, _free_port())
        if server is not None:
            return server
    raise RuntimeError(f"the loopback sshd could not listen on a free port: {(folder / 'sshd.log').read_text()}")


def _start_sshd(sshd: str, folder: Path, port: int) -> LoopbackSshd | None:
    """sshd on ``port`` once a login works; None when it ended before (the port was taken)."""
    import getpass

    (folder / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {folder / 'host_key'}\n"
        f"AuthorizedKeysFile {folder / 'client_key.pub'}\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "PermitRootLogin prohibit-password\n"
        "StrictModes no\n"  # the temporary folders are not the home's; CI runs as root
        # bash, the login shell that runs each session's command, reads ~/.bashrc when sshd starts it unless it is a
        # nested shell: a machine's own .bashrc (pyenv's init on the CI image: a hundred processes, 0.1 s) would
        # otherwise be the most of every mailbox operation the tests time; what they check is opalctl's commands
        "SetEnv SHLVL=1\n"
        "PidFile none\nLogLevel VERBOSE\n")
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {(folder / 'host_key.pub').read_text()}")
    (folder / "ssh_config").write_text(
        f"Host {SSHD_ALIAS}\n  HostName 127.0.0.1\n  Port {port}\n  User {getpass.getuser()}\n"
        f"  IdentityFile {folder / 'client_key'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {folder / 'known_hosts'}\n  StrictHostKeyChecking yes\n  LogLevel ERROR\n")
    with open(folder / "sshd.log", "wb") as log:
        process = subprocess.Popen([sshd, "-D", "-e", "-f", str(folder / "sshd_config")], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = LoopbackSshd(folder / "ssh_config", SSHD_ALIAS, port, folder, process)
    deadline = time.monotonic() + 30
    while True:
        login = subprocess.run(["ssh", "-F", str(server.config), "-o", "BatchMode=yes", SSHD_ALIAS, "true"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        if login.returncode == 0:
            return server
        if process.poll() is not None:
            return None
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"the loopback sshd did not take a login: {login.stderr.decode(errors='replace')}"
                               f"{server.log}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> LoopbackSshd:
    """A real sshd on loopback for this session (this xdist worker): ``sshd.config``, ``sshd.host``,
    ``sshd.target(folder)``."""
    server = start_loopback_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
