"""The chain of digests of one run folder, checked: pure functions from what was read to findings.

The chain (its shapes are formats.py's, its module docstring says what names what): ``start.json`` -> the lock
and ``initial.pt``; ``anchor.json`` -> its own digest; each ``stage-NN.json`` -> its checkpoint and the anchor;
``last.json`` and ``selected.json`` -> a stage's checkpoint; ``report.json`` -> every one of them, the steps file
and itself. ``verify/folder.py`` reads a run folder into a ``RunFolder`` (the only part that touches files);
``check_run`` says everything wrong with it, one ``Finding`` per mismatch, each naming its file.

A finding is ``damaged`` (the file is missing or cannot be read as its record), ``changed`` (it reads, but no
longer matches the digest or the record that vouches for it) or a ``note`` (something the chain cannot check,
such as a record written before the chain existed); a note never fails a check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opalctl.formats import (
    AnchorRecord,
    LastRecord,
    RecordDamaged,
    RunDigests,
    RunReport,
    SelectedRecord,
    StageRecord,
    StartRecord,
    anchor_sha256,
    report_sha256,
)
from opalctl.layout import LAST, REPORT, SELECTED, START, STEPS, RunLayout

DAMAGED, CHANGED, NOTE = "damaged", "changed", "note"

# the names of a run folder's records, which lie at its root: what a finding calls a file, as the layout names it
RECORDS = RunLayout(".")


def record_name(stage: int) -> str:
    """``stage-NN.json``, stage ``stage``'s record as the layout names it."""
    return RECORDS.stage_record(stage).name


@dataclass(frozen=True)
class Finding:
    """One thing wrong with one file (``file`` relative to the run folder), said as a clause."""

    file: str
    problem: str
    kind: str = CHANGED

    def line(self) -> str:
        return f"{self.file}: {self.problem}"

    def to_json(self) -> dict[str, str]:
        return {"file": self.file, "problem": self.problem, "kind": self.kind}


@dataclass
class RecordRead:
    """A JSON record as read: its sha256 (None: missing), its value, or why it cannot be read."""

    name: str
    sha256: str | None
    value: Any = None
    error: str | None = None  # a clause: "is not JSON (cut short or damaged)"


@dataclass
class CheckpointRead:
    """A checkpoint as read: its file's sha256 (None: missing) and, when it was loaded, its ``model_sha256`` or
    the sentence that refused it."""

    name: str
    sha256: str | None
    loaded: bool = False
    model_sha256: str | None = None
    error: str | None = None


@dataclass
class StepsRead:
    """``steps.jsonl.gz`` as read (``name``: relative to the run folder): its sha256 (None: missing), its complete
    lines, the last one's update and running digest, whether every line is numbered in turn, or why it cannot be
    read."""

    sha256: str | None
    name: str = STEPS
    lines: int = 0
    last_update: int | None = None
    last_seen: str | None = None
    numbered: bool = True
    error: str | None = None


@dataclass
class AgentRecords:
    """An agent arm's two accounts of its decisions, as read: the agent host's (what it answered, written where the
    training process cannot write) and the training process's (what became of each answer, and the programs it
    loaded), each program as the sha256 of its text (``opal/records.program_sha256``)."""

    answered: dict[int, dict[str, str] | None]  # decision -> file -> sha256 the host answered (None: it failed)
    outcomes: dict[int, tuple[str, int | None]]  # decision -> (outcome event, version) in training's events
    loaded: dict[int, dict[str, str | None]]  # version -> file -> sha256 of programs/vNNN/file (None: missing)
    events: str  # the training events' name, relative to the run folder
    programs: str  # the training programs' folder, relative to the run folder
    unreadable: list[Finding] = field(default_factory=list)  # host records that cannot be read


@dataclass
class RunFolder:
    """Everything of one run folder the chain names, as read."""

    start: RecordRead
    stages: list[RecordRead]  # every stage-NN.json, in order
    last: RecordRead
    selected: RecordRead
    report: RecordRead
    anchor: RecordRead
    steps: StepsRead
    # by their names relative to the run folder: "initial.pt", "training/stage-01.pt"
    checkpoints: dict[str, CheckpointRead] = field(default_factory=dict)
    # each stage record's name -> the name of the checkpoint the layout puts beside it (opalctl/layout.py)
    stage_checkpoints: dict[str, str] = field(default_factory=dict)
    resumable: bool = False  # a resume checkpoint is there
    agent: AgentRecords | None = None  # an agent arm's records, where the agent host kept its own


def _shape(cls, record: RecordRead, findings: list[Finding]):
    """The record as ``cls``, or None with a finding: missing or unreadable (damaged), or not of that shape."""
    if record.sha256 is None:
        findings.append(Finding(record.name, "is missing", DAMAGED))
        return None
    if record.error is not None:
        findings.append(Finding(record.name, record.error, DAMAGED))
        return None
    try:
        return cls.from_json(record.value, what=record.name)
    except RecordDamaged as error:
        findings.append(Finding(record.name, error.message.removeprefix(f"{record.name} ").split("; ")[0], DAMAGED))
        return None


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest is not None else "none"


# -- the records before the verdict ----------------------------------------------------------------------------

def check_start_links(start: StartRecord, initial: CheckpointRead | None, lock_sha256: str | None) -> list[Finding]:
    """``start.json`` against the lock (when known) and ``initial.pt``."""
    out = []
    if lock_sha256 is not None and start.lock_sha256 != lock_sha256:
        out.append(Finding(START, f"names lock {_short(start.lock_sha256)}, not {_short(lock_sha256)}"))
    if initial is not None:
        out += check_checkpoint(initial, start.initial, START)
    return out


def check_checkpoint(checkpoint: CheckpointRead, named: dict[str, Any], by: str) -> list[Finding]:
    """A checkpoint file against the record that names it (``by``): the file's sha256, then what it loads to."""
    if checkpoint.sha256 is None:
        return [Finding(checkpoint.name, f"is missing ({by} names it)", DAMAGED)]
    if not checkpoint.sha256:  # not a file that can be read: a FIFO, a device, a link
        return [Finding(checkpoint.name, checkpoint.error or "cannot be read", DAMAGED)]
    out = []
    if checkpoint.sha256 != named.get("sha256"):
        out.append(Finding(checkpoint.name, f"has sha256 {_short(checkpoint.sha256)}, {by} records "
                                            f"{_short(named.get('sha256'))}"))
    if checkpoint.error is not None:
        out.append(Finding(checkpoint.name, f"does not load: {checkpoint.error}"))
    elif checkpoint.loaded and checkpoint.model_sha256 != named.get("model_sha256"):
        out.append(Finding(checkpoint.name, f"holds model {_short(checkpoint.model_sha256)}, {by} records "
                                            f"{_short(named.get('model_sha256'))}"))
    return out


def check_anchor(anchor: AnchorRecord, name: str, start: StartRecord | None) -> list[Finding]:
    """``anchor.json`` against its own digest and the run's start record."""
    out = []
    if anchor.sha256 is None:
        out.append(Finding(name, "predates the chain of digests (it has no sha256): its metrics cannot be checked",
                           NOTE))
    elif anchor.sha256 != anchor_sha256(anchor.to_json()):
        out.append(Finding(name, "no longer matches its digest (its content was edited)"))
    if start is not None and anchor.lock_sha256 != start.lock_sha256:
        out.append(Finding(name, f"was made from lock {_short(anchor.lock_sha256)}, start.json names "
                                 f"{_short(start.lock_sha256)}"))
    if start is not None and anchor.model_sha256 != start.anchor.get("model_sha256"):
        out.append(Finding(name, "is of another parent model than start.json names"))
    return out


def check_stage(stage: StageRecord, name: str, checkpoint: CheckpointRead | None, own_checkpoint: str | None,
                anchor_digest: str | None) -> list[Finding]:
    """One stage record: its number, its checkpoint file (``own_checkpoint``: the name the layout gives it) and the
    anchor it was judged against."""
    out = []
    if name != record_name(stage.stage):
        out.append(Finding(name, f"holds the record of stage {stage.stage}"))
    if stage.checkpoint.get("file") != own_checkpoint:
        out.append(Finding(name, f"names checkpoint {stage.checkpoint.get('file')!r}, not its own"))
    if checkpoint is not None:
        out += check_checkpoint(checkpoint, stage.checkpoint, name)
    if stage.anchor_sha256 is None:
        out.append(Finding(name, "predates the chain of digests: the anchor it was judged against is not named",
                           NOTE))
    elif anchor_digest is not None and stage.anchor_sha256 != anchor_digest:
        out.append(Finding(name, f"was judged against anchor {_short(stage.anchor_sha256)}, the anchor record is "
                                 f"{_short(anchor_digest)}"))
    return out


def check_sequence(stages: list[tuple[str, StageRecord]], fractions: list[float] | None) -> list[Finding]:
    """The stages in turn: numbered 1, 2, ... at the protocol's fractions, each decided from the incumbent the one
    before it left."""
    out = []
    incumbent: int | str = "anchor"
    expected = 1
    for name, stage in stages:
        if name == record_name(stage.stage) and stage.stage > expected:  # the ones before it are gone
            out += [Finding(record_name(gone), f"is missing (stage {stage.stage}'s record is there)", DAMAGED)
                    for gone in range(expected, stage.stage)]
            expected = stage.stage
        elif stage.stage != expected:
            out.append(Finding(name, f"is stage {stage.stage} where stage {expected} was next"))
        index, expected = expected - 1, expected + 1
        if fractions is not None and (index >= len(fractions) or stage.fraction != fractions[index]):
            out.append(Finding(name, f"is at fraction {stage.fraction}, not one the run's budget has in that place"))
        if stage.incumbent_before != incumbent:
            out.append(Finding(name, f"was decided against incumbent {stage.incumbent_before!r}, the stage before "
                                     f"left {incumbent!r}"))
        after = stage.stage if stage.promoted else stage.incumbent_before
        if stage.incumbent_after != after or stage.promoted != bool(stage.decision.get("promoted")):
            out.append(Finding(name, "its promotion, decision and incumbent disagree"))
        incumbent = stage.incumbent_after
    return out


def check_last(last: LastRecord, stages: list[StageRecord]) -> list[Finding]:
    if not stages:
        return [Finding(LAST, "names a stage, and the run has no stage records")]
    final = stages[-1]
    expected = {"stage": final.stage, "update": final.update, **final.checkpoint}
    got = {key: value for key, value in last.to_json().items() if key != "format"}
    if {key: got.get(key) for key in expected} != expected:
        return [Finding(LAST, f"does not name stage {final.stage}'s checkpoint as {record_name(final.stage)} "
                                     f"records it")]
    return []


def check_selected(selected: SelectedRecord, stages: list[StageRecord], anchor: AnchorRecord | None) -> list[Finding]:
    """``selected.json``: the last promoted stage's checkpoint and metrics, or the anchor's, flagged."""
    chosen = stages[-1].incumbent_after if stages else "anchor"
    if chosen == "anchor":
        if selected.source != "anchor" or not selected.flagged:
            return [Finding(SELECTED, "selects a stage, and no stage was promoted")]
        if anchor is not None and (selected.metrics != anchor.metrics
                                   or selected.checkpoint.get("model_sha256") != anchor.model_sha256):
            return [Finding(SELECTED, "does not hold the anchor record's metrics and model")]
        return []
    stage = next((s for s in stages if s.stage == chosen), None)
    if selected.source != "stage" or stage is None or selected.stage != chosen:
        return [Finding(SELECTED, f"does not select stage {chosen}, the incumbent the last stage left")]
    named = {key: stage.checkpoint.get(key) for key in ("file", "sha256", "model_sha256")}
    if {key: selected.checkpoint.get(key) for key in named} != named or selected.metrics != stage.metrics:
        return [Finding(SELECTED, f"does not hold stage {chosen}'s checkpoint and metrics as "
                                         f"{record_name(chosen)} records them")]
    return []


def check_steps_reach_stages(steps: StepsRead, stages: list[StageRecord]) -> list[Finding]:
    name = steps.name
    if steps.sha256 is None:
        return [Finding(name, "is missing", DAMAGED)]
    if steps.error is not None:
        return [Finding(name, steps.error, DAMAGED)]
    if not steps.numbered:
        return [Finding(name, "holds lines that are not numbered 1, 2, ... in turn")]
    if stages and steps.lines < stages[-1].update:
        return [Finding(name, f"holds {steps.lines} complete lines, and stage {stages[-1].stage} was reached at "
                              f"update {stages[-1].update}")]
    return []


# -- the verdict -----------------------------------------------------------------------------------------------

def check_digests(digests: RunDigests, folder: RunFolder, report: dict[str, Any]) -> list[Finding]:
    """Every digest ``report.json`` records against the file it names, and the report's own."""
    out = []
    if digests.report != report_sha256(report):
        out.append(Finding(REPORT, "no longer matches its own digest (a figure in it was edited)"))
    files = {START: (digests.start, folder.start.sha256), LAST: (digests.last, folder.last.sha256),
             SELECTED: (digests.selected, folder.selected.sha256),
             folder.steps.name: (digests.steps, folder.steps.sha256)}
    on_disk = {stage.name: stage.sha256 for stage in folder.stages}
    for name in sorted(set(digests.stages) | set(on_disk)):
        files[name] = (digests.stages.get(name), on_disk.get(name))
    for name, (recorded, found) in files.items():
        if recorded is None and found is not None:
            out.append(Finding(name, "is not a record the report names (it was added after the run)"))
        elif found is None and recorded is not None:
            out.append(Finding(name, "is missing (report.json names it)", DAMAGED))
        elif recorded != found:
            out.append(Finding(name, f"has sha256 {_short(found)}, report.json records {_short(recorded)}"))
    if folder.anchor.value is not None and isinstance(folder.anchor.value, dict) and \
            digests.anchor != anchor_sha256(folder.anchor.value):
        out.append(Finding(folder.anchor.name, f"is not the anchor record the run was judged against (report.json "
                                               f"records {_short(digests.anchor)})"))
    return out


def check_report(report: RunReport, raw: dict[str, Any], folder: RunFolder, stages: list[StageRecord],
                 start: StartRecord | None) -> list[Finding]:
    """``report.json``: its digests, then each figure it repeats from another record."""
    out: list[Finding] = []
    if report.digests is None and any("anchor_sha256" in stage for stage in report.stages):
        out.append(Finding(REPORT, "lacks the digests of the chain its stage records belong to (they were "
                                          "removed)"))
    elif report.digests is None:
        out.append(Finding(REPORT, "predates the chain of digests (it has no digests): only its figures "
                                          "are checked against the other records", NOTE))
    else:
        try:
            out += check_digests(RunDigests.from_json(report.digests, what="its digests"), folder, raw)
        except RecordDamaged:
            return out + [Finding(REPORT, "holds digests that are not of their shape", DAMAGED)]
    mine = [stage.to_json() for stage in stages]
    if [_without_seconds(s) for s in report.stages] != [_without_seconds(s) for s in mine]:
        out.append(Finding(REPORT, "lists stages that are not the stage records"))
    if report.promoted_stages != [stage.stage for stage in stages if stage.promoted]:
        out.append(Finding(REPORT, "lists promoted stages that are not the stage records' promotions"))
    selected = folder.selected.value if isinstance(folder.selected.value, dict) else {}
    if {key: selected.get(key) for key in ("source", "stage", "flagged")} != \
            {key: report.selected.get(key) for key in ("source", "stage", "flagged")}:
        out.append(Finding(REPORT, "selects another model than selected.json"))
    if stages and report.final_model_sha256 != stages[-1].checkpoint.get("model_sha256"):
        out.append(Finding(REPORT, "names another final model than the last stage's checkpoint"))
    anchor = folder.anchor.value if isinstance(folder.anchor.value, dict) else {}
    if "metrics" in anchor and report.anchor_metrics != anchor["metrics"]:
        out.append(Finding(REPORT, "holds anchor metrics that are not the anchor record's"))
    if start is not None and (report.lock_sha256, report.arm, report.seed) != (start.lock_sha256, start.arm,
                                                                               start.seed):
        out.append(Finding(REPORT, "names another lock, arm or seed than start.json"))
    steps = folder.steps
    if steps.error is None and steps.sha256 is not None and (report.updates != steps.lines
                                                             or report.rows_digest != steps.last_seen):
        out.append(Finding(REPORT, f"counts {report.updates} updates, {steps.name} holds {steps.lines} "
                                          f"(or another rows digest)"))
    return out


def _without_seconds(stage: dict[str, Any]) -> dict[str, Any]:
    """A stage record without ``eval_seconds`` (a report written before the chain may have other ones)."""
    return {key: value for key, value in stage.items() if key != "eval_seconds"}


def check_agent_records(records: AgentRecords) -> list[Finding]:
    """The training process's account of the agent's decisions against the agent host's: every version it says it
    applied must be, file for file, the programs the host answered at that decision (a training process that put
    its records back to the released programs, or to anything else, is caught); a decision the host answered that
    the training process says nothing of is noted (a run resumed from before it asked that decision again)."""
    out = list(records.unreadable)
    for decision, (kind, version) in sorted(records.outcomes.items()):
        if kind != "applied":
            continue
        answered = records.answered.get(decision)
        if answered is None:
            out.append(Finding(records.events, f"says decision {decision} applied version {version}, and the agent "
                                               f"host recorded no programs answered at it"))
            continue
        for name, digest in sorted(answered.items()):
            loaded = records.loaded.get(version, {}).get(name)
            if loaded != digest:
                out.append(Finding(f"{records.programs}/v{version:03d}/{name}",
                                   "is missing" if loaded is None else
                                   f"is not the program the agent host answered at decision {decision}"))
    if any(finding.file == records.events for finding in records.unreadable):
        return out  # events that cannot be read say nothing of any decision: that one finding is the whole story
    for decision in sorted(set(records.answered) - set(records.outcomes)):
        out.append(Finding(records.events, f"says nothing of decision {decision}, which the agent host answered",
                           NOTE))
    return out


def check_completion(folder: RunFolder) -> list[Finding]:
    """A folder that is neither finished nor resumable lost its report or its resume checkpoint."""
    if folder.report.sha256 is not None or folder.resumable:
        return []
    if folder.last.sha256 is not None or folder.selected.sha256 is not None:
        return [Finding(REPORT, "is missing, and last.json or selected.json says the run closed", DAMAGED)]
    return [Finding(REPORT, "is missing, and there is no resume checkpoint: the run stopped before its first "
                                   "resume checkpoint, or its resume checkpoint is gone", NOTE)]


# -- the whole folder ------------------------------------------------------------------------------------------

def check_run(folder: RunFolder, lock_sha256: str | None = None, anchor_required: bool = True) -> list[Finding]:
    """Every finding about one run folder, in the order of the chain (start, anchor, stages, closing records,
    steps, report). Without ``anchor_required`` a missing anchor record is a note (a run folder copied alone)."""
    out: list[Finding] = []
    start = _shape(StartRecord, folder.start, out)
    if start is not None:
        out += check_start_links(start, folder.checkpoints.get(str(start.initial.get("file"))), lock_sha256)
    anchor = _shape(AnchorRecord, folder.anchor, out) if folder.anchor.sha256 is not None else None
    if anchor is not None:
        out += check_anchor(anchor, folder.anchor.name, start)
    anchor_digest = anchor_sha256(anchor.to_json()) if anchor is not None else None
    named: list[tuple[str, StageRecord]] = []
    for record in folder.stages:
        stage = _shape(StageRecord, record, out)
        if stage is not None:
            named.append((record.name, stage))
            own = folder.stage_checkpoints.get(record.name)
            out += check_stage(stage, record.name, folder.checkpoints.get(own or ""), own, anchor_digest)
    stages = [stage for _, stage in named]
    out += check_sequence(named, list(start.budget.get("fractions") or []) if start is not None else None)
    out += check_completion(folder)
    out += check_agent_records(folder.agent) if folder.agent is not None else []
    out += check_steps_reach_stages(folder.steps, stages) if folder.report.sha256 is not None or folder.steps.sha256 else []
    if folder.report.sha256 is None:
        return out + _anchor_missing(folder, anchor_required)
    if (last := _shape(LastRecord, folder.last, out)) is not None:
        out += check_last(last, stages)
    if (selected := _shape(SelectedRecord, folder.selected, out)) is not None:
        out += check_selected(selected, stages, anchor)
    if (report := _shape(RunReport, folder.report, out)) is not None:
        out += check_report(report, folder.report.value, folder, stages, start)
    return out + _anchor_missing(folder, anchor_required)


def _anchor_missing(folder: RunFolder, required: bool) -> list[Finding]:
    """A missing anchor record, said last: a folder copied without its anchors is told what else is wrong first."""
    if folder.anchor.sha256 is not None:
        return []
    if required:
        return [Finding(folder.anchor.name, "is missing (the stages were judged against it)", DAMAGED)]
    return [Finding(folder.anchor.name, "is not there (the run folder was copied without the anchors?): the anchor "
                                        "the stages were judged against is not checked", NOTE)]


def failures(findings: list[Finding]) -> list[Finding]:
    return [finding for finding in findings if finding.kind != NOTE]
