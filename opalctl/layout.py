"""The run folders: every file of a lock's runs named in one place, who writes it, and what state a run is in.

Like submitit's ``JobPaths``, one object names every file of a job, so the run, the evaluator, the grid, verify,
show, compare, the report page and export never spell a name themselves::

    runs/NAME-SHA12/                            LockRuns (the folder of one lock's runs)
        report.html                             the report page (opalctl report)
        anchors/seed-S/anchor.json              the evaluator: the parent's metrics, once per seed
        ARM/.seed-S.lock                        the run folder's lock, beside it (nothing is written into it)
        ARM/seed-S.abandoned-N/                 an attempt that --restart moved aside, whole
        ARM/seed-S/                             RunLayout (one run of one arm on one seed)
            start.json                          the evaluator, from what training sent before agent code could run
            initial.pt                          the training process, before it is confined
            stage-NN.json  last.json            the evaluator
            selected.json  report.json          the evaluator
            grid.log                            the grid (what the run printed)
            notes/NNN.json                      opalctl say: a note a person left for the agent (opal/notes.py),
                                                read by the training process, which may not write there
            agent/                              the agent host: workspace/, decisions/NNN/ (each decision as the
                                                host saw it: the request, the answer, the programs), refused.jsonl
            training/                           the training process's own, and the only place it may write once
                                                confined: stage-NN.pt, resume.pt, steps.jsonl.gz, opal/ (the agent
                                                optimizer's records, its account of what ran)

**Who may write what.** Every record that states a result (the start, stage, last, selected and report records, the
anchor, the agent host's records) is written by a process no agent code runs in (the evaluator, the agent host)
into places the confined training process of an agent arm cannot write: Landlock grants it ``training/`` alone.
What training writes there (its checkpoints, its steps, its resume state, the agent optimizer's records) is its
claim; the evaluator hashes each stage checkpoint from the bytes it judged, so a later rewrite is caught.

A run folder made before this layout (its checkpoints, steps and ``opal/`` beside the records, no ``training/``)
still reads: ``RunLayout.training`` is then the run folder itself (``legacy``).

**States.** ``RunLayout.state`` is the one place that decides where a run stands, from its files: ``new`` (no
start record), ``at update 0`` (started, but neither a resume checkpoint nor a steps line: continuing it is
starting it again, nothing is lost), ``resumable`` (a resume checkpoint), ``started`` (started, trained, and
without a resume checkpoint: only ``--restart`` continues it) and ``finished`` (a report). Those are what the
files say; ``RunLayout.live_state`` is where the run stands as any other process sees it now: ``running`` while a
process holds the folder's lock (the run, or its evaluator or steps helper, which inherit it), else ``state``. The
grid, ``grid --status`` and the readers ask ``live_state``; a run deciding under its own lock asks ``state``.

The names of a lock and an arm become folders, so each must be a plain name (``name_problem``): a pattern that
never leaves the runs folder (``NAME_PATTERN``: no ``/``, not ``.`` or ``..``), none of the names opalctl gives a file
or folder of its own beside the arms' folders (``RESERVED_NAMES``: an arm named ``report.html`` or ``anchors`` would
be the lock's report page or anchors), and nothing a YAML reader or a number parser reads as another value (``5``, ``1e3``, ``nan``, ``true``:
a protocol that names it reads back as a number). The protocol's schema holds protocol files to the same rule, and
every reader of a lock holds the lock to it (protocol/lock.py), before any folder is made.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

from opalctl.errors import BadInput

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a protocol's or an arm's name; never "." or ".."

NEW, AT_UPDATE_0, RESUMABLE, STARTED, FINISHED = "new", "at update 0", "resumable", "started", "finished"
RUNNING = "running"  # live_state only: a process holds the folder's lock

START, INITIAL, LAST, SELECTED, REPORT = "start.json", "initial.pt", "last.json", "selected.json", "report.json"
GRID_LOG = "grid.log"
TRAINING, AGENT = "training", "agent"
RESUME, STEPS, OPAL = "resume.pt", "steps.jsonl.gz", "opal"
WORKSPACE, DECISIONS = "workspace", "decisions"
# the agent optimizer's line-by-line records in opal/ (opal/records.py, opal/hangs.py write them), by stream
OPAL_STREAM_FILES = {"events": "events.jsonl", "losses": "losses.jsonl", "reports": "reports.jsonl"}
HUNG = "hung.jsonl"
PROGRAMS = "programs"  # opal/programs/vNNN/: each version's programs as loaded (version_name)
NOTES = "notes"
ANCHOR, ANCHORS = "anchor.json", "anchors"
REPORT_PAGE = "report.html"
# the names opalctl gives what it writes beside the arms' folders in a lock's folder (the rest there starts with a
# dot, which no name may): no arm, and so that one rule holds both, no lock may be named so
RESERVED_NAMES = frozenset({ANCHORS, REPORT_PAGE})


def runs_dir_default(value: str | os.PathLike | None) -> Path:
    """The runs folder: ``--runs-dir``, else ``OPALCTL_RUNS``, else ``./runs``."""
    return Path(value or os.environ.get("OPALCTL_RUNS") or "runs")


def stage_name(stage: int) -> str:
    """``stage-NN`` of stage number ``stage`` (1 for the first fraction)."""
    return f"stage-{stage:02d}"


def version_name(number: int) -> str:
    """``vNNN`` of the agent's program version ``number`` (0 the starting program): its folder beneath
    ``opal/programs`` and its name in records and messages."""
    return f"v{int(number):03d}"


def name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a lock's or an arm's name (a clause: "cannot name a folder ..."), or None."""
    if not isinstance(value, str) or not re.fullmatch(NAME_PATTERN, value):
        return ("cannot name a folder (use up to 64 letters, digits, '.', '_' and '-', starting with a letter or a "
                "digit)")
    if value in RESERVED_NAMES:
        return (f"is the name of what opalctl writes beside the arms' folders ({', '.join(sorted(RESERVED_NAMES))}), "
                f"so it cannot be an arm's")
    if _reads_as_another_value(value):
        return "reads as a number or another value, not as a name, where a protocol gives it (use letters too)"
    return None


def _reads_as_another_value(value: str) -> bool:
    """Whether YAML (a protocol file) or Python's number parsing reads ``value`` as anything but this string."""
    import yaml  # here, not at the top: the CLI imports this module at start-up (opalctl --help)

    for number in (float, lambda text: int(text, 0)):  # 1e3, nan, inf, 1_000; 0x1F, 0o17, 0b1
        try:
            number(value)
            return True
        except ValueError:
            pass
    try:
        return yaml.safe_load(value) != value
    except yaml.YAMLError:
        return True


def plain_name(value: object, what: str, where: str) -> str:
    """``value`` when it can be a lock's or an arm's name (``name_problem``), else a refusal naming ``where``
    (exit 2)."""
    if problem := name_problem(value):
        raise BadInput(f"{where}: {what} {value!r} {problem}; freeze a protocol with another {what}")
    return value


@dataclass(frozen=True)
class AnchorFolder:
    """``anchors/seed-S/``: the anchor of one seed, written by the evaluator."""

    folder: Path

    @property
    def record(self) -> Path:
        return self.folder / ANCHOR


@dataclass(frozen=True)
class LockRuns:
    """``runs/NAME-SHA12/``: every run of one lock."""

    base: Path

    @classmethod
    def of(cls, runs_dir: str | os.PathLike, lock) -> LockRuns:
        name = plain_name(lock.name, "name", f"lock {lock.path}")
        return cls(Path(runs_dir) / f"{name}-{lock.sha12}")

    def run(self, arm: str, seed: int) -> RunLayout:
        plain_name(arm, "arm", f"the runs of {self.base.name}")
        return RunLayout(self.base / arm / f"seed-{int(seed)}", self.anchor(seed))

    def anchor(self, seed: int) -> AnchorFolder:
        return AnchorFolder(self.base / ANCHORS / f"seed-{int(seed)}")

    def seeds_of(self, arm: str) -> list[RunLayout]:
        """The run folders of ``arm`` that are there (``seed-S`` with S a number), in seed order."""
        found = []
        for folder in (self.base / arm).glob("seed-*"):
            number = folder.name.removeprefix("seed-")
            if folder.is_dir() and number.isdigit():
                found.append((int(number), self.run(arm, int(number))))
        return [layout for _, layout in sorted(found)]

    @property
    def report_page(self) -> Path:
        return self.base / REPORT_PAGE


def flock_holders(status: os.stat_result) -> set[int]:
    """The ids of the processes ``/proc/locks`` says took an flock on the file of ``status`` (``OSError`` where the
    system does not say): the process that took it, whoever inherited it since."""
    inode = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    listed = Path("/proc/locks").read_text().splitlines()
    return {int(fields[4]) for fields in (line.split() for line in listed)
            if fields[1:2] == ["FLOCK"] and fields[5:6] == [inode] and fields[4].isdigit()}


class RunLayout:
    """``runs/NAME-SHA12/ARM/seed-S/``: every file of one run, and the state it is in (module docstring)."""

    def __init__(self, root: str | os.PathLike, anchor: AnchorFolder | None = None):
        self.root = Path(root)
        # a run folder knows its anchor by where it lies (runs/NAME-SHA12/ARM/seed-S -> runs/NAME-SHA12/anchors)
        self.anchor = anchor or AnchorFolder(self.root.parent.parent / ANCHORS / self.root.name)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    @classmethod
    def of(cls, run_dir: str | os.PathLike) -> RunLayout:
        return cls(Path(run_dir))

    # -- the records (written by the evaluator and the agent host) ---------------------------------------------
    @property
    def start(self) -> Path:
        return self.root / START

    @property
    def initial(self) -> Path:
        return self.root / INITIAL

    def stage_record(self, stage: int) -> Path:
        return self.root / f"{stage_name(stage)}.json"

    def stage_records(self) -> list[Path]:
        """The stage records there are, in order."""
        return sorted(self.root.glob("stage-[0-9][0-9].json"))

    @property
    def last(self) -> Path:
        return self.root / LAST

    @property
    def selected(self) -> Path:
        return self.root / SELECTED

    @property
    def report(self) -> Path:
        return self.root / REPORT

    @property
    def grid_log(self) -> Path:
        return self.root / GRID_LOG

    @property
    def agent(self) -> Path:
        """The agent host's folder: its workspace and the decisions as it saw them."""
        return self.root / AGENT

    @property
    def workspace(self) -> Path:
        return self.agent / WORKSPACE

    @property
    def host_decisions(self) -> Path:
        """The agent host's record of each decision, ``agent/decisions/NNN``."""
        return self.agent / DECISIONS

    @property
    def decisions(self) -> Path:
        """Where a reader finds each decision's record: the agent host's (``agent/decisions``) in a run folder with
        an ``agent/`` folder; else (a folder made before the host kept records, or whose backend answers in the
        training process: ``keep``) the training process's (``opal/decisions``)."""
        return self.host_decisions if self.agent.is_dir() else self.opal / DECISIONS

    def decision_folder(self, number: int) -> Path:
        """Decision ``number``'s record, where ``decisions`` says."""
        return self.decisions / f"{int(number):03d}"

    def decision_numbers(self) -> list[int]:
        """The numbers of the decisions recorded there, in order."""
        folder = self.decisions
        found = folder.glob("[0-9][0-9][0-9]") if folder.is_dir() else []
        return sorted(int(path.name) for path in found if path.is_dir())

    @property
    def notes(self) -> Path:
        """The notes a person left for the agent (``opalctl say``): ``notes/NNN.json``, one file per note."""
        return self.root / NOTES

    def note_file(self, number: int) -> Path:
        return self.notes / f"{int(number):03d}.json"

    # -- training's own ------------------------------------------------------------------------------------------
    @property
    def legacy(self) -> bool:
        """A folder made before ``training/`` existed: training's files lie beside the records."""
        if (self.root / TRAINING).is_dir():
            return False
        return any((self.root / name).exists() for name in (STEPS, RESUME, OPAL, "stage-01.pt"))

    @property
    def training(self) -> Path:
        """The only folder a confined training process may write."""
        return self.root if self.legacy else self.root / TRAINING

    def stage_checkpoint(self, stage: int) -> Path:
        return self.training / f"{stage_name(stage)}.pt"

    @property
    def resume(self) -> Path:
        return self.training / RESUME

    @property
    def steps(self) -> Path:
        return self.training / STEPS

    @property
    def opal(self) -> Path:
        """The agent optimizer's own records (events, losses, reports, programs as loaded, hung versions)."""
        return self.training / OPAL

    @property
    def events(self) -> Path:
        """The agent optimizer's events, ``opal/events.jsonl``."""
        return self.opal / OPAL_STREAM_FILES["events"]

    def program_version(self, number: int) -> Path:
        """The programs of version ``number`` as the training process loaded them, ``opal/programs/vNNN``."""
        return self.opal / PROGRAMS / version_name(number)

    @property
    def hung(self) -> Path:
        """The versions whose calls hung, ``opal/hung.jsonl`` (opal/hangs.py)."""
        return self.opal / HUNG

    def name_of(self, path: Path) -> str:
        """``path`` as a record names it: relative to the run folder (``training/stage-01.pt``)."""
        return Path(os.path.relpath(path, self.root)).as_posix()

    def path_of(self, name: str) -> Path:
        """The file a record names (``name_of``'s inverse); never outside the run folder."""
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"{name!r} does not name a file of a run folder")
        return self.root.joinpath(*parts)

    # -- beside it ---------------------------------------------------------------------------------------------
    @property
    def folder_lock(self) -> Path:
        return self.root.parent / f".{self.root.name}.lock"

    def abandoned(self) -> list[Path]:
        """The attempts ``--restart`` moved aside (``seed-S.abandoned-N``), in order."""
        found = []
        for path in self.root.parent.glob(f"{self.root.name}.abandoned-*"):
            number = path.name.rpartition("-")[2]
            if number.isdigit():
                found.append((int(number), path))
        return [path for _, path in sorted(found)]

    def next_abandoned(self) -> Path:
        taken = [int(path.name.rpartition("-")[2]) for path in self.abandoned()]
        return self.root.parent / f"{self.root.name}.abandoned-{1 + max(taken, default=0)}"

    # -- where it stands ---------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``new``, ``at update 0``, ``resumable``, ``started`` or ``finished`` (module docstring)."""
        if self.report.exists():
            return FINISHED
        if self.resume.exists():
            return RESUMABLE
        if self.start.exists():
            steps = self.steps
            return AT_UPDATE_0 if not steps.exists() or steps.stat().st_size == 0 else STARTED
        return NEW

    def held(self) -> bool:
        """Whether a process holds the folder's lock now (tried without waiting and released at once; the lock is
        never created here). A lock dies with the last process holding it, so a held lock is a live holder's."""
        try:
            fd = os.open(self.folder_lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # not a lock a run takes (a FIFO or a folder in its place): no run holds it
            return False
        finally:
            os.close(fd)
        return False

    def lock_holders(self) -> set[int] | None:
        """The ids of the processes that took the folder's lock and hold it now, by ``/proc/locks`` (a run's
        evaluator and steps helper hold it under the run's id, even after the run has died); None where the
        system does not say."""
        try:
            return flock_holders(os.stat(self.folder_lock))
        except OSError:
            return None

    @property
    def live_state(self) -> str:
        """``running`` while a process holds the folder's lock, else ``state`` (module docstring)."""
        return RUNNING if self.held() else self.state

    def is_run_folder(self) -> bool:
        """A folder opalctl ran in: it holds a start record, or any record only a run writes."""
        return self.root.is_dir() and (self.state != NEW or self.stage_record(1).exists())
