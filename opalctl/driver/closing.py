"""The records that close a formal run: ``last.json``, ``selected.json`` and ``report.json``.

The evaluator writes all three (driver/evaluator.py), from what it holds: the stage records and the incumbent it
judged, the final weights (the last stage's, which its judge loaded; the last update always reaches it), the
initial weights (``initial.pt``, which the training process wrote before it was confined), what the kernel counted
of the training process, and the training facts the training process sent at the close (``formats.TrainingFacts``:
ledger, meter, rows digest, agent figures), reported as that process's account.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from opalctl.driver.budget import clock_spec
from opalctl.driver.evaluation import recorded_metrics
from opalctl.files import atomic_write_json, sha256_file
from opalctl.formats import (
    LastRecord,
    RunDigests,
    RunReport,
    SelectedRecord,
    StageRecord,
    TrainingFacts,
    anchor_sha256,
    record_sha256,
    report_sha256,
)
from opalctl.layout import RunLayout


@dataclass
class ClosingInputs:
    """What the closing records are made of: the evaluator's stages and incumbent, the training facts."""

    stages: list[StageRecord]
    incumbent: Any  # judge.Incumbent
    training: TrainingFacts
    initial_model: dict[str, Any]  # initial.pt's weights
    final_model: dict[str, Any]  # the last stage checkpoint's weights
    confinement: dict[str, Any] | None = None  # the training process's, as it reported it
    machine: dict[str, Any] | None = None  # driver/sharing.py's MachineWatch.to_json(), from the evaluator
    process: dict[str, Any] | None = None  # what the kernel counted of the training process (kernel_account.py)


def selected_record(lock, seed: int, incumbent, anchor: dict[str, Any]) -> SelectedRecord:
    """``selected.json``: the incumbent, or the anchor (flagged) when no stage qualified."""
    if incumbent.stage is None:
        return SelectedRecord(
            source="anchor", stage=None, flagged=True,
            reason="no stage qualified under the promotion policy; the selected model is the anchor",
            checkpoint={"file": str(lock.parent_path(seed)), "sha256": lock.records[f"parent.seed-{seed}"]["sha256"],
                        "model_sha256": anchor["model_sha256"]},
            metrics=anchor["metrics"])
    return SelectedRecord(source="stage", stage=incumbent.stage, flagged=False, checkpoint=incumbent.checkpoint,
                          metrics=recorded_metrics(incumbent.metrics))


def parameter_change(initial: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    """How far training moved each floating-point tensor from its initial value (L2, and relative to it). A
    tensor that is not finite at the end (a diverged run's) has None for both, and is named in ``nonfinite``."""
    import torch  # here: the evaluator process imports this module as it starts, before it may import torch

    changes, nonfinite = {}, []
    total_delta, total_norm = 0.0, 0.0
    for name, tensor in final.items():
        if not tensor.is_floating_point():
            continue
        delta = float(torch.linalg.vector_norm((tensor - initial[name]).double()))
        norm = float(torch.linalg.vector_norm(initial[name].double()))
        if not math.isfinite(delta):
            nonfinite.append(name)
            changes[name] = {"l2": None, "relative": None}
            continue
        changes[name] = {"l2": delta, "relative": delta / norm if norm > 0 else None}
        total_delta += delta ** 2
        total_norm += norm ** 2
    if nonfinite:
        return {"l2": None, "relative": None, "tensors": changes, "nonfinite": nonfinite}
    return {"l2": total_delta ** 0.5, "relative": (total_delta ** 0.5) / (total_norm ** 0.5) if total_norm else None,
            "tensors": changes}


def nonfinite_limitations(stages: list[StageRecord], change: dict[str, Any]) -> list[str]:
    """What a diverged run's report says of it: a result, stated (not a failure)."""
    out = []
    if change.get("nonfinite"):
        names = change["nonfinite"]
        out.append(f"The final weights are not finite ({len(names)} tensor(s): {', '.join(names[:3])}"
                   f"{', ...' if len(names) > 3 else ''}): the run diverged.")
    unfinite = [(stage.stage, [name for name, value in stage.metrics.items() if value is None]) for stage in stages]
    unfinite = [(number, names) for number, names in unfinite if names]
    if unfinite:
        said = "; ".join(f"stage {number}: {', '.join(names[:3])}" for number, names in unfinite[:4])
        out.append(f"Some stage metrics were not finite and are recorded as null ({said}"
                   f"{'; ...' if len(unfinite) > 4 else ''}); no stage with such a metric in a promotion rule "
                   f"is promoted.")
    return out


def limitations(arm_name: str, seed: int, budget, outcome: ClosingInputs, splits: dict[str, Any],
                change: dict[str, Any]) -> list[str]:
    """The report's limitations: what its figures cannot say, in sentences."""
    training, ledger = outcome.training, outcome.training.ledger
    out = [f"One run of arm {arm_name!r} on seed {seed}: a single seed says nothing about spread; "
           f"compare arms across all seeds with `opalctl compare`.",
           clock_spec(budget.clock).limitation(budget.threads)]
    if training.overshoot > 0:
        out.append(f"The last update overshot the budget by {training.overshoot:.6g} "
                   f"({100 * training.overshoot / training.budget_total:.2f} %), as no update is cut short.")
    if outcome.incumbent.stage is None:
        out.append("No stage qualified under the promotion policy: the selected model is the anchor (flagged).")
    integrity = (training.agent or {}).get("eval_integrity")
    if integrity and integrity["flagged"]:
        out.append(f"Evaluation integrity: {integrity['flagged']} round trip(s) of the parameters around an "
                   f"evaluation ({', '.join(integrity['tensors'][:3])}): a program moved them for the evaluation "
                   f"and back; do not trust this arm's stage metrics.")
    if ledger["resumes"]:
        out.append(f"The run was resumed {ledger['resumes']} time(s); clock totals are the sum of the sessions.")
    if ledger["nonfinite_losses"]:
        out.append(f"{ledger['nonfinite_losses']} update(s) had a non-finite loss.")
    out += nonfinite_limitations(outcome.stages, change)
    if training.final_model_sha256 != outcome.stages[-1].checkpoint["model_sha256"]:
        out.append("The training process's model at the end is not the last stage's checkpoint, which is what "
                   "this report's final model and parameter change describe.")
    held_out = [split for split in splits if split != "train"]
    out.append(f"Metrics come from {len(held_out)} held-out split(s) of fixed size; differences of a few counts "
               f"can be noise.")
    return out


def close_run(layout: RunLayout, lock, arm_name: str, seed: int, protocol, outcome: ClosingInputs,
              anchor: dict[str, Any], splits: dict[str, Any]) -> dict[str, Any]:
    """Write ``last.json``, ``selected.json`` and ``report.json``; return the report."""
    last_stage = outcome.stages[-1]
    last = LastRecord(stage=last_stage.stage, update=last_stage.update, **last_stage.checkpoint).to_json()
    atomic_write_json(layout.last, last)
    chosen = selected_record(lock, seed, outcome.incumbent, anchor)
    selected = chosen.to_json()
    atomic_write_json(layout.selected, selected)
    budget, training, ledger = protocol.budget, outcome.training, outcome.training.ledger
    arm = protocol.arms[arm_name]
    change = parameter_change(outcome.initial_model, outcome.final_model)
    report = RunReport(
        lock_sha256=lock.sha256, protocol=lock.name, arm=arm_name, seed=seed,
        budget={"clock": budget.clock, "total": training.budget_total, "used": training.budget_used,
                "overshoot": training.overshoot, "fractions": list(budget.fractions), "threads": budget.threads,
                "multiplier": arm.budget_multiplier},
        updates=training.updates, examples_seen=ledger["examples"], rows_digest=training.rows_digest,
        seconds={"train_cpu": ledger["train_cpu"], "train_wall": ledger["train_wall"],
                 "eval_wall": ledger["eval_wall"], "checkpoint_wall": ledger["checkpoint_wall"],
                 "agent_wait_wall": ledger["agent_wait_wall"], "this_session_loop_wall": ledger["loop_wall"],
                 "this_session_wall": training.session_wall, "this_session_cpu": training.session_cpu},
        peak_memory_bytes=training.peak_memory_bytes,
        parameter_change=change,
        stages=[stage.to_json() for stage in outcome.stages],
        promoted_stages=[stage.stage for stage in outcome.stages if stage.promoted],
        selected=chosen.summary(),
        final_model_sha256=last["model_sha256"], anchor_metrics=anchor["metrics"], agent=training.agent,
        resumes=ledger["resumes"], nonfinite_losses=ledger["nonfinite_losses"],
        limitations=limitations(arm_name, seed, budget, outcome, splits, change),
        peak_device_memory_bytes=training.peak_device_memory_bytes, confinement=outcome.confinement,
        machine=outcome.machine, ranks=protocol.training.ranks, process=outcome.process)
    # report.json is written once, with the digests of the chain it closes (verify/chain.py)
    data = sealed_report(layout, report.to_json(), outcome.stages, anchor_sha256(anchor), last, selected)
    atomic_write_json(layout.report, data)
    return data


def sealed_report(layout: RunLayout, report: dict[str, Any], stages: list[StageRecord], anchor_digest: str,
                  last: dict[str, Any], selected: dict[str, Any]) -> dict[str, Any]:
    """The report with its ``digests`` (formats.RunDigests): the stage, last and selected records hashed from the
    records this process holds (the ones it wrote), ``start.json`` and the steps file (the training process's)
    hashed from the disk as they are now, and the report's own digest last."""
    steps = layout.steps
    digests = RunDigests(
        start=sha256_file(layout.start), steps=sha256_file(steps) if steps.is_file() else None,
        stages={layout.stage_record(stage.stage).name: record_sha256(stage.to_json()) for stage in stages},
        last=record_sha256(last), selected=record_sha256(selected), anchor=anchor_digest)
    sealed = {**report, "digests": digests.to_json()}
    sealed["digests"]["report"] = report_sha256(sealed)
    return sealed
