"""The command line: parse, call, print. No logic lives here, and nothing heavy is imported at module level.

``opalctl --help`` must be instant, so torch (and everything that imports it) is imported inside the commands.
Every command that reports takes ``--json``. Errors that opalctl anticipates (``opalctl.errors``) become one
sentence on stderr and their exit code: 1 a failure while working, 2 bad input, 3 a frozen input changed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import click

from opalctl import __version__
from opalctl.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_SIGNALLED, BadInput, Interrupted, OpalctlError
from opalctl.opal.agents.default_model import DEFAULT_EFFORT, DEFAULT_MODEL
from opalctl.quick_exit import end_without_teardown

json_option = click.option("--json", "json_mode", is_flag=True, help="Print one JSON document on stdout.")


def _seeds(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        raise click.BadParameter("give integers separated by commas, e.g. 1,2,3") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="opalctl")
def cli() -> None:
    """Pre-registered, budget-honest comparisons of agent-steered optimizers against fixed ones.

    A typical session: init a built-in task (or write a protocol), freeze it, pilot an arm, then run each arm
    and seed and compare them.
    """


@cli.command()
@click.argument("task")
@click.option("--dir", "folder", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Folder for the protocol, its data and parents.")
@click.option("--seeds", default=None, help="Seeds to write parents for, e.g. 1,2,3 (default 1,2,3).")
@json_option
def init(task: str, folder: str, seeds: str | None, json_mode: bool) -> None:
    """Write a ready protocol for a built-in TASK (digits, pylm, modular, illcond, shapes), its data files and parents."""
    from opalctl import console
    from opalctl.tasks.builtin import init as run_init

    result = run_init(task, folder, _seeds(seeds), say=console.message)
    if json_mode:
        console.print_json(result)
        return
    console.table(f"opalctl init {task}", ["file", "status"], [[f["path"], f["status"]] for f in result["files"]])
    console.message(f"next: opalctl freeze {result['protocol']}")


@cli.command()
@click.argument("protocol", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace an existing lock that differs.")
@json_option
def freeze(protocol: str, force: bool, json_mode: bool) -> None:
    """Validate PROTOCOL, hash every input and write NAME.lock.json beside it."""
    from opalctl import console
    from opalctl.protocol.freeze import freeze as run_freeze

    result = run_freeze(protocol, force=force)
    if json_mode:
        console.print_json(result)
        return
    console.pairs(f"opalctl freeze {protocol}", [
        ("lock", result["lock"]), ("sha256", result["sha256"]), ("outcome", result["outcome"]),
        ("records", result["records"]), ("seeds", ", ".join(map(str, result["seeds"]))),
        ("arms", ", ".join(result["arms"]))])
    for warning in result["warnings"]:
        console.message(f"warning: {warning}")
    if result["outcome"] == "replaced":
        lock_name = os.path.basename(result["lock"]).removesuffix(".json")
        console.message(f"the lock it replaced is kept beside it as {lock_name}.SHA12.json (SHA12: the first 12 hex "
                        f"digits of its sha256, as in its run folders' names runs/{result['name']}-SHA12)")


@cli.command()
@click.argument("target", type=click.Path())
@click.option("--runs", "with_runs", is_flag=True, help="With a lock: check every run folder of it too.")
@click.option("--runs-dir", default=None, type=click.Path(file_okay=False),
              help="Where run folders live (default: $OPALCTL_RUNS or ./runs).")
@json_option
def verify(target: str, with_runs: bool, runs_dir: str | None, json_mode: bool) -> None:
    """Re-hash every record of a lock, or check a run folder's chain of digests; exit 3 naming each mismatch.

    TARGET is a lock file (with --runs, its run folders too) or a run folder (runs/NAME-SHA/ARM/seed-S)."""
    from opalctl import console
    from opalctl.errors import EXIT_CHANGED
    from opalctl.verify.command import run_failure, verify_target

    result = verify_target(target, runs=with_runs, runs_dir=runs_dir)
    if json_mode:
        console.print_json(result)
    elif result["kind"] != "lock":
        for note in result.get("notes", []):
            console.message(f"note: {note['file']}: {note['problem']}")
        if not result["ok"]:
            raise run_failure(result)
        checked = result.get("runs", [result])
        sys.stdout.write(f"ok: {len(checked)} run folder(s) of {target} verify, every record and checkpoint of "
                         f"the chain\n")
    elif result["ok"]:
        sys.stdout.write(f"ok: {result['checked']} records of {target} match (sha256 {result['sha256'][:12]})\n")
    else:
        console.table(f"{len(result['problems'])} changed input(s) in {target}", ["role", "path", "status"],
                      [[p["role"], p["path"], p["status"]] for p in result["problems"]])
    if not result["ok"]:
        if not json_mode:
            console.message("restore the files listed, or freeze the protocol again (a new lock is a new protocol)")
        sys.exit(EXIT_CHANGED)


@cli.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("--arm", required=True, help="The arm to measure.")
@click.option("--steps", default=24, show_default=True, type=click.IntRange(1, 100_000),
              help="Updates to time, at the least (after a warm-up).")
@click.option("--seconds", default=3.0, show_default=True, type=click.FloatRange(0, 3600),
              help="Wall seconds of timed updates, at the least.")
@click.option("--seed", default=None, type=int, help="Which seed's parent (default: the first seed).")
@json_option
def pilot(source: str, arm: str, steps: int, seconds: float, seed: int | None, json_mode: bool) -> None:
    """Measure an arm's throughput on public inputs only and forecast its run's wall time; never formal, writes
    nothing."""
    from opalctl import console
    from opalctl.driver.forecast import run_lines
    from opalctl.driver.pilot import pilot as run_pilot

    with console.progress(f"pilot {arm}", json_mode) as progress:
        result = run_pilot(source, arm, steps=steps, seconds=seconds, seed=seed, progress=progress)
    if json_mode:
        console.print_json(result)
        return
    budget = result["budget"]
    console.pairs(f"opalctl pilot {arm} (not a formal run)", [
        ("seconds per update (cpu)", result["cpu_seconds_per_update"]),
        ("seconds per update (wall)", result["wall_seconds_per_update"]),
        ("updates per cpu-second", result["updates_per_cpu_second"]),
        (f"projected updates ({budget['amount']:g} {budget['clock']})", result["projected_updates"]),
        ("checkpoint size", console.size(result["checkpoint_bytes"])),
        ("peak memory (process)", console.size(result["peak_memory_bytes"])),
        ("parameters", result["parameters"]),
        ("threads", result["threads"]),
        ("loss first -> last", f"{result['loss_first']:.4f} -> {result['loss_last']:.4f}"),
    ])
    sys.stdout.write("".join(f"{line}\n" for line in run_lines(result["forecast"])))
    for note in result["notes"]:
        console.message(f"note: {note}")
    if "agent_forecast" in result:
        from opalctl.opal.estimate import format_lines

        sys.stdout.write("agent forecast:\n" + "\n".join("  " + line for line in format_lines(result["agent_forecast"]))
                         + "\n")


@cli.command()
@click.option("--total-steps", required=True, type=click.IntRange(1, None), help="Updates in the run.")
@click.option("--sec-per-step", required=True, type=float, help="Seconds per update (from `opalctl pilot`).")
@click.option("--decisions", default=None, type=click.IntRange(1, None),
              help="Decisions to ask (default: the most whose waiting stays within 4x the training time).")
@click.option("--no-blocking", is_flag=True, help="Training does not wait for the agent.")
@click.option("--auto", "auto_blocking", is_flag=True, help="Wait only when an answer would land late.")
@click.option("--max-lag", default=50, show_default=True, type=click.IntRange(0, None),
              help="With --auto: updates an answer may land late without training waiting.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--effort", default=DEFAULT_EFFORT, show_default=True)
@json_option
def estimate(total_steps: int, sec_per_step: float, decisions: int | None, no_blocking: bool, auto_blocking: bool,
             max_lag: int, model: str, effort: str, json_mode: bool) -> None:
    """Forecast how long training waits for the agent and what the agent costs."""
    from opalctl import console
    from opalctl.errors import BadInput
    from opalctl.opal.estimate import estimate as run_estimate
    from opalctl.opal.estimate import format_lines

    if no_blocking and auto_blocking:
        raise BadInput("--no-blocking and --auto exclude each other; choose one")
    blocking = "auto" if auto_blocking else (not no_blocking)
    result = run_estimate(total_steps, sec_per_step, decisions=decisions, blocking=blocking, max_lag=max_lag,
                          model=model, effort=effort)
    if json_mode:
        console.print_json(result)
        return
    sys.stdout.write("\n".join(format_lines(result)) + "\n")


runs_dir_option = click.option("--runs-dir", default=None, type=click.Path(file_okay=False),
                               help="Where run folders live (default: $OPALCTL_RUNS or ./runs).")


@cli.command(name="run")
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--arm", required=True, help="The arm to train.")
@click.option("--seed", required=True, type=int, help="The seed (one of the lock's seeds).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint.")
@click.option("--restart", is_flag=True,
              help="Start a started, unfinished run again from update 0; its folder is kept as seed-S.abandoned-N.")
@runs_dir_option
@json_option
def run_command(lock: str, arm: str, seed: int, resume: bool, restart: bool, runs_dir: str | None,
                json_mode: bool) -> None:
    """One formal run of ARM on SEED under the lock's budget.

    A lock whose training.ranks is N > 1 is run by torchrun on one machine:
    torchrun --nproc-per-node N -m opalctl run LOCK --arm ARM --seed SEED"""
    from opalctl import console
    from opalctl.driver.ranks import prints_here
    from opalctl.driver.run import run as formal_run

    say = None if json_mode else console.message
    with console.progress(f"{arm} seed {seed}", json_mode) as progress:
        report = formal_run(lock, arm, seed, runs_dir=runs_dir, resume=resume, restart=restart, progress=progress,
                            say=say, confine=(click.get_current_context().obj or {}).get("own_process", False))
    if not prints_here():
        return
    acted = report["agent_acted"]  # whether its agent acted: a warning and exit 5 (compare/decisions.py)
    if json_mode:
        console.print_json(report)
    else:
        _run_summary(arm, seed, report)
    if acted["warning"]:
        console.message("warning: " + acted["warning"])
    sys.exit(acted["exit_code"])


def _run_summary(arm: str, seed: int, report: dict) -> None:
    from opalctl import console
    from opalctl.compare.decisions import COUNTS

    budget = report["budget"]
    selected = report["selected"]
    console.pairs(f"opalctl run {arm} seed {seed}", [
        ("run folder", report["run_dir"]),
        ("updates", report["updates"]),
        (f"budget used ({budget['clock']})", f"{budget['used']:.6g} of {budget['total']:.6g} "
                                             f"(overshoot {budget['overshoot']:.3g})"),
        ("training seconds (cpu / wall)", f"{report['seconds']['train_cpu']:.2f} / {report['seconds']['train_wall']:.2f}"),
        ("promoted stages", ", ".join(map(str, report["promoted_stages"])) or "none"),
        ("selected", f"stage {selected['stage']}" if selected["source"] == "stage" else "the anchor (flagged: no "
                                                                                      "stage qualified)"),
        *([("agent decisions", ", ".join(f"{counts[key]} {key.replace('_', ' ')}" for key in COUNTS))]
          if (counts := report["agent_acted"]["decisions"]) else []),
    ])


@cli.command()
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--baseline", default=None, help="The arm others are paired against (default: the first arm run).")
@click.option("--stage", default="selected", show_default=True,
              help="Which model of each run: selected (the policy's), last, or a stage number.")
@click.option("--metric", "metrics", multiple=True, help="Compare only this metric (repeat for more).")
@click.option("--csv", "csv_mode", is_flag=True, help="Print one CSV row per arm and metric on stdout.")
@runs_dir_option
@json_option
def compare(lock: str, baseline: str | None, stage: str, metrics: tuple[str, ...], csv_mode: bool,
            runs_dir: str | None, json_mode: bool) -> None:
    """The arms of LOCK side by side across seeds, with paired differences to the baseline and a verdict."""
    from opalctl import console
    from opalctl.compare.aggregate import compare as run_compare
    from opalctl.compare.csv_table import write_csv
    from opalctl.compare.render import render_compare

    result = run_compare(lock, baseline=baseline, runs_dir=runs_dir, stage=stage, metrics=list(metrics))
    if json_mode:
        console.print_json(result)
    elif csv_mode:
        write_csv(result)
    else:
        render_compare(result, chosen=bool(metrics))


@cli.command()
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--arm", required=True, help="The agent arm whose decisions are replayed.")
@click.option("--from-seed", "from_seed", default=None, type=int,
              help="The seed whose decisions are replayed on the others (default: the first finished one).")
@click.option("--force", is_flag=True, help="Replace a control protocol or lock that differs.")
@runs_dir_option
@json_option
def control(lock: str, arm: str, from_seed: int | None, force: bool, runs_dir: str | None, json_mode: bool) -> None:
    """Write a post-hoc control lock for an agent arm of LOCK: its decisions on one seed replayed on the others
    (and the fixed arm its programs equal, when LOCK lacks one). Run it with `opalctl grid`; `compare LOCK` shows it."""
    from opalctl import console
    from opalctl.protocol.add_control import make_control

    result = make_control(lock, arm, from_seed=from_seed, runs_dir=runs_dir, force=force)
    if json_mode:
        console.print_json(result)
        return
    console.pairs(f"opalctl control {lock} --arm {arm}", [
        ("lock", result["lock"]), ("sha256", result["sha256"]), ("outcome", result["outcome"]),
        ("parent", f"{result['parent']} ({result['parent_sha256'][:12]})"),
        ("replays", f"seed {result['from_seed']} on seeds {', '.join(map(str, result['replayed_on']))}"),
        ("arms", ", ".join(result["arms"]))])
    console.message("marked post-hoc (added after the fact, not pre-registered); next: " + result["next"])


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--reasons", is_flag=True, help="Print every refusal's reason in full under the stages.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              help="Write the run's report page (one offline HTML file) to this path.")
@json_option
def show(run_dir: str, reasons: bool, html_path: str | None, json_mode: bool) -> None:
    """One run: its stages, promotions and the reasons for each decision."""
    from opalctl import console
    from opalctl.driver.show import show as run_show
    from opalctl.driver.show_render import render_show

    result = run_show(run_dir)
    if html_path:
        from opalctl.report.run_page import write_run_page

        console.message(f"wrote {write_run_page(run_dir, html_path)}")
    if json_mode:
        console.print_json(result)
        return
    render_show(result, reasons=reasons)


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("text")
@json_option
def say(run_dir: str, text: str, json_mode: bool) -> None:
    """Leave a note for the agent of a running agent arm: shown at its next decision, and recorded (who, when,
    which decision saw it); compare and the report mark the runs that received notes. The arm's protocol must
    allow notes (agent: {notes: allowed})."""
    from opalctl import console
    from opalctl.opal.notes import say as leave_note

    note = leave_note(run_dir, text)
    if json_mode:
        console.print_json(note)
        return
    console.message(f"note {note['note']} left for the agent of {note['run_dir']} ({note['path']}); it is shown at "
                    f"the run's next decision")


@cli.command()
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for report.html (default: the lock's runs folder).")
@runs_dir_option
@json_option
def report(lock: str, out_dir: str | None, runs_dir: str | None, json_mode: bool) -> None:
    """Write one offline HTML page of LOCK's runs: verdicts, tables, plots, decisions, limitations."""
    from opalctl import console
    from opalctl.report.grid_page import write_grid_page

    path = write_grid_page(lock, runs_dir=runs_dir, out=out_dir)
    if json_mode:
        console.print_json({"page": str(path)})
        return
    sys.stdout.write(f"{path}\n")


@cli.command()
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--tensorboard", "tensorboard_dir", default=None, type=click.Path(),
              help="Folder for TensorBoard event files, one subfolder per run.")
@click.option("--wandb", "wandb_dir", default=None, type=click.Path(),
              help="Folder for offline W&B runs (DIR/wandb/offline-run-*), for `wandb sync` to upload.")
@click.option("--mlflow", "mlflow_dir", default=None, type=click.Path(),
              help="Folder for an MLflow store (DIR/mlflow.db and DIR/artifacts) that `mlflow ui` opens.")
@runs_dir_option
@json_option
def export(lock: str, tensorboard_dir: str | None, wandb_dir: str | None, mlflow_dir: str | None,
           runs_dir: str | None, json_mode: bool) -> None:
    """Write LOCK's finished runs for a tracker: TensorBoard, W&B (offline) or MLflow (a local store)."""
    from opalctl import console

    chosen = [(flag, folder) for flag, folder in
              (("--tensorboard", tensorboard_dir), ("--wandb", wandb_dir), ("--mlflow", mlflow_dir)) if folder]
    if len(chosen) != 1:
        raise click.UsageError("give one of --tensorboard DIR, --wandb DIR or --mlflow DIR (one tracker per export)")
    if tensorboard_dir:
        from opalctl.export import export_tensorboard

        result = export_tensorboard(lock, tensorboard_dir, runs_dir=runs_dir)
        next_step = f"tensorboard --logdir {result['tensorboard']}"
        lines = result["runs"]
    elif wandb_dir:
        from opalctl.trackers.wandb_offline import export_wandb

        result = export_wandb(lock, wandb_dir, runs_dir=runs_dir)
        next_step, lines = result["upload"], result["runs"]
    else:
        from opalctl.trackers.mlflow_store import export_mlflow

        result = export_mlflow(lock, mlflow_dir, runs_dir=runs_dir)
        next_step = result["open"]
        lines = [f"{name} {run_id}" for name, run_id in result["runs"].items()]
    if json_mode:
        console.print_json(result)
        return
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    console.message(f"next: {next_step}")


@cli.command()
@click.argument("lock", type=click.Path(dir_okay=False))
@click.option("--arm", "arms", multiple=True, help="Run only this arm (repeat for more; default: every arm).")
@click.option("--seed", "seeds", multiple=True, type=int, help="Run only this seed (repeat for more; default: all).")
@click.option("--jobs", default=None, type=click.IntRange(1, None),
              help="Runs at once (default: the cores divided by the lock's budget.threads).")
@click.option("--executor", default="local", show_default=True, type=click.Choice(["local", "slurm"]),
              help="Where the runs train: child processes here, or a Slurm job array (through submitit).")
@click.option("--status", "status_only", is_flag=True, help="Only say where each run stands (and its Slurm job).")
@click.option("--forecast", "forecast_only", is_flag=True,
              help="Only forecast the wall time of the runs left at --jobs (a pilot of each arm); start nothing.")
@click.option("--slurm-config", default=None, type=click.Path(dir_okay=False),
              help="A YAML file of Slurm settings (partition, account, time_limit_minutes, sbatch, ...).")
@click.option("--partition", default=None, help="Slurm partition (over the file's).")
@click.option("--account", default=None, help="Slurm account (over the file's).")
@click.option("--time-limit", "time_limit_minutes", default=None, type=click.IntRange(1, None),
              help="Slurm time limit per run, in minutes (default: the pilot's projection with a margin).")
@click.option("--sbatch", "sbatch", multiple=True, help="Another sbatch option as KEY=VALUE (repeat for more).")
@runs_dir_option
@click.option("--json", "json_mode", is_flag=True, help="One JSON line per state change, then one for the grid.")
def grid(lock: str, arms: tuple[str, ...], seeds: tuple[int, ...], jobs: int | None, executor: str,
         status_only: bool, forecast_only: bool, slurm_config: str | None, partition: str | None,
         account: str | None, time_limit_minutes: int | None, sbatch: tuple[str, ...], runs_dir: str | None,
         json_mode: bool) -> None:
    """Every arm and seed of LOCK, each an `opalctl run` of its own, then the comparison (docs/grid.md)."""
    from opalctl import console
    from opalctl.grid import live_display, run_grid
    from opalctl.grid.settings import load_settings, parse_sbatch_options
    from opalctl.grid.status import grid_status, render_status
    from opalctl.grid.summary import closing_compare, exit_code, print_json_end, render_end

    if status_only:
        result = grid_status(lock, arms=list(arms) or None, seeds=list(seeds) or None, runs_dir=runs_dir)
        console.print_json(result) if json_mode else render_status(result)
        return
    if forecast_only:
        from opalctl.driver.forecast import grid_lines
        from opalctl.grid.forecast import forecast_grid

        result = forecast_grid(lock, arms=list(arms) or None, seeds=list(seeds) or None, jobs=jobs,
                               runs_dir=runs_dir, say=console.message)
        console.print_json(result) if json_mode else sys.stdout.write("".join(f"{line}\n"
                                                                              for line in grid_lines(result)))
        return
    settings = load_settings(slurm_config, partition=partition, account=account,
                             time_limit_minutes=time_limit_minutes, sbatch=parse_sbatch_options(sbatch))
    result = run_grid(lock, arms=list(arms) or None, seeds=list(seeds) or None, jobs=jobs, executor=executor,
                      runs_dir=runs_dir, display=live_display(json_mode), settings=settings)
    comparison, note = closing_compare(result)
    print_json_end(result, comparison, note) if json_mode else render_end(result, comparison, note)
    sys.exit(exit_code(result, comparison))


@cli.group()
def suite() -> None:
    """One comparison over several tasks: freeze a suite file, run every task's grid, summarise across tasks
    (time-to-target, performance profiles and their scores; docs/suite.md)."""


suite_dir_option = click.option("--dir", "folder", default=None, type=click.Path(file_okay=False),
                                help="The suite's folder (default: a folder named after the suite beside its file).")


@suite.command("freeze")
@click.argument("suite_file", type=click.Path(dir_okay=False))
@suite_dir_option
@click.option("--force", is_flag=True, help="Replace task protocols and locks that differ (the old locks are kept).")
@json_option
def suite_freeze(suite_file: str, folder: str | None, force: bool, json_mode: bool) -> None:
    """Write and freeze every task's protocol of SUITE_FILE, then the suite lock naming their locks."""
    from opalctl import console
    from opalctl.suite.freeze import freeze_suite
    from opalctl.suite.render import render_freeze

    result = freeze_suite(suite_file, folder=folder, force=force, say=console.message)
    console.print_json(result) if json_mode else render_freeze(result)
    if not json_mode:
        console.message(f"next: opalctl suite run {result['suite_lock']}")


@suite.command("run")
@click.argument("suite_target", type=click.Path(dir_okay=False))
@suite_dir_option
@click.option("--jobs", default=None, type=click.IntRange(1, None),
              help="Runs at once (default: the cores divided by the lock's budget.threads).")
@click.option("--executor", default="local", show_default=True, type=click.Choice(["local", "slurm"]),
              help="Where the runs train: child processes here, or a Slurm job array (through submitit).")
@click.option("--slurm-config", default=None, type=click.Path(dir_okay=False),
              help="A YAML file of Slurm settings (partition, account, time_limit_minutes, sbatch, ...).")
@runs_dir_option
@click.option("--json", "json_mode", is_flag=True, help="One JSON line per state change, then one for the suite.")
def suite_run(suite_target: str, folder: str | None, jobs: int | None, executor: str, slurm_config: str | None,
              runs_dir: str | None, json_mode: bool) -> None:
    """Run every task's grid of a frozen suite (SUITE_TARGET: the suite lock, or the suite file), resumable."""
    from opalctl import console
    from opalctl.grid import live_display
    from opalctl.grid.settings import load_settings
    from opalctl.suite.render import print_run_end, render_run_end
    from opalctl.suite.run import TaskDisplay, open_suite, run_suite

    lock = open_suite(suite_target, folder)
    settings = load_settings(slurm_config) if slurm_config else None
    result = run_suite(lock, jobs=jobs, executor=executor, runs_dir=runs_dir, settings=settings,
                       display_for=lambda task: TaskDisplay(task, live_display(json_mode)), say=console.message)
    print_run_end(result) if json_mode else render_run_end(result, str(lock.path))
    if not result["ok"]:
        sys.exit(EXIT_FAILURE)


@suite.command("status")
@click.argument("suite_target", type=click.Path(dir_okay=False))
@suite_dir_option
@runs_dir_option
@json_option
def suite_status_command(suite_target: str, folder: str | None, runs_dir: str | None, json_mode: bool) -> None:
    """Where every run of every task of the suite stands (read from the run folders)."""
    from opalctl import console
    from opalctl.suite.render import render_status
    from opalctl.suite.run import open_suite, suite_status

    result = suite_status(open_suite(suite_target, folder), runs_dir=runs_dir)
    console.print_json(result) if json_mode else render_status(result)


@suite.command("summary")
@click.argument("suite_target", type=click.Path(dir_okay=False))
@suite_dir_option
@runs_dir_option
@click.option("--html", "out", default=None, type=click.Path(file_okay=False),
              help="Also write the suite's page (suite.html) into this folder.")
@json_option
def suite_summary(suite_target: str, folder: str | None, runs_dir: str | None, out: str | None,
                  json_mode: bool) -> None:
    """Each task's time-to-target per arm, every arm's performance profile and score, and what they can say."""
    from opalctl import console
    from opalctl.suite.page import write_suite_page
    from opalctl.suite.render import render_summary
    from opalctl.suite.run import open_suite
    from opalctl.suite.summary import summarise

    summary = summarise(open_suite(suite_target, folder), runs_dir=runs_dir)
    if out is not None:
        summary["page"] = str(write_suite_page(summary, out))
    if json_mode:
        console.print_json(summary)
        return
    render_summary(summary)
    if out is not None:
        console.message(f"page: {summary['page']}")


@suite.command("report")
@click.argument("suite_target", type=click.Path(dir_okay=False))
@suite_dir_option
@runs_dir_option
@click.option("--out", "out", default=None, type=click.Path(file_okay=False),
              help="Folder for suite.html (default: the suite lock's folder).")
@json_option
def suite_report(suite_target: str, folder: str | None, runs_dir: str | None, out: str | None,
                 json_mode: bool) -> None:
    """Write the suite's page: the profiles figure, the scores, the statement and every task's tables."""
    from opalctl import console
    from opalctl.suite.page import write_suite_page
    from opalctl.suite.run import open_suite
    from opalctl.suite.summary import summarise

    lock = open_suite(suite_target, folder)
    page = write_suite_page(summarise(lock, runs_dir=runs_dir), out if out is not None else lock.path.parent)
    if json_mode:
        console.print_json({"page": str(page), "suite_lock": str(lock.path)})
    else:
        sys.stdout.write(f"{page}\n")


@cli.command()
@click.argument("target", type=click.Path())
@click.option("--interval", default=1.5, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds between two looks at the run folders.")
@click.option("--once", is_flag=True, help="Print the view as it stands and exit (with --json: one JSON document).")
@runs_dir_option
@click.option("--json", "json_mode", is_flag=True, help="One JSON line per change (with --once: one document).")
def watch(target: str, interval: float, once: bool, runs_dir: str | None, json_mode: bool) -> None:
    """A live view of one run (TARGET a run folder) or every run of a lock (TARGET a lock), read from the run
    folders alone: state, budget, ETA, loss, learning rate, stages as judged, decisions as made."""
    from opalctl import console
    from opalctl.watch import watch as run_watch

    result = run_watch(target, runs_dir=runs_dir, interval=interval, once=once, json_mode=json_mode)
    if result is not None:
        console.print_json(result)


# the time is demo.DURATION, written out so that --help does not import the demo's grid (tests/test_demo.py)
@cli.command(help="One real comparison on the built-in digits task, end to end: a mis-tuned learning rate, "
                  "its anneal-end control, the offline heuristic agent and a tuned one, 3 seeds each, then the "
                  "verdict and the report page (about a minute on 2 cores).")
@click.option("--dir", "folder", default=os.path.join("runs", "demo"), show_default=True,
              type=click.Path(file_okay=False), help="Folder for the demo's protocol, data and lock.")
@runs_dir_option
@json_option
def demo(folder: str, runs_dir: str | None, json_mode: bool) -> None:
    from opalctl import console
    from opalctl.compare.render import render_compare
    from opalctl.demo import StateLines
    from opalctl.demo import demo as run_demo
    from opalctl.grid import live_display

    display = None if json_mode else live_display() if console.rich_enabled(sys.stdout) else StateLines(
        console.message)
    try:
        result = run_demo(folder, runs_dir=runs_dir, say=console.message, display=display)
    finally:
        getattr(display, "close", lambda: None)()
    if json_mode:
        console.print_json(result)
        return
    render_compare(result["compare"])
    for arm, rules in result["rules"].items():
        console.paragraph(f"rules the heuristic fired in {arm}'s decisions: "
                          + ", ".join(f"{rule} {count}" for rule, count in rules.items()))
    console.paragraph("demo verdict, on the selected models (the protocol's answer):")
    for sentence in result["verdict"]:
        console.paragraph(sentence, indent="  ")
    console.paragraph("and at the last stage (what training reached, whatever the promotion policy chose):")
    for sentence in result["verdict_last"]:
        console.paragraph(sentence, indent="  ")
    console.paragraph(f"report page: {result['report_page']}")
    console.message(f"lock {result['lock']} ({result['verified_records']} records verified); runs under "
                    f"{result['compare']['runs']}; each run: opalctl show {result['compare']['runs']}/ARM/seed-S")


@cli.group()
def agent() -> None:
    """The agent away from the training machine: serve a mailbox of decisions."""


@agent.command(name="serve")
@click.argument("mailbox")
@click.option("--backend", required=True, help="The backend that answers (anthropic); its key is this machine's.")
@click.option("--model", default=None, help="Answer only requests for this model (default: any).")
@click.option("--max-concurrent", default=4, show_default=True, type=int, help="Decisions worked at once.")
@click.option("--lease-seconds", default=60.0, show_default=True, type=float,
              help="How long a lease holds without renewal (a killed server's requests are taken again after it).")
@click.option("--ssh", "ssh_target", default=None, metavar="HOST",
              help="Reach MAILBOX, a folder on HOST, with the ssh client (keys and ~/.ssh/config as you use them).")
@click.option("--json", "json_mode", is_flag=True, help="Print one JSON line per event on stdout.")
def agent_serve(mailbox: str, backend: str, model: str | None, max_concurrent: int, lease_seconds: float,
                ssh_target: str | None, json_mode: bool) -> None:
    """Answer the decisions asked in MAILBOX (runs with `backend: mailbox`) until Ctrl-C, which releases every
    lease so that the next server answers at once."""
    from opalctl import console
    from opalctl.opal.mailbox.serve import Server, line_of, mailbox_folder

    def show(event: dict) -> None:
        if json_mode:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
        else:
            console.message(line_of(event))

    server = Server(mailbox_folder(mailbox, ssh_target), backend, model=model, max_concurrent=max_concurrent,
                    lease_seconds=lease_seconds, show=show)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    try:
        server.serve()
    except KeyboardInterrupt:
        pass


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the click group and turn anticipated errors into a sentence and an exit code; a process of
    opalctl's own (``argv`` None) ends without the interpreter's teardown of torch (``opalctl.quick_exit``)."""
    try:
        _command(argv)
    except SystemExit as done:
        if argv is None:
            end_without_teardown(done.code)
        raise


def _command(argv: list[str] | None) -> None:
    try:
        if argv is None:
            # a process opalctl owns: `opalctl run` starts again at once without the secret-looking variables,
            # which wait in a pipe for its agent host alone (opalctl.opal.handover); the pipe is kept from every
            # other child
            from opalctl.opal.handover import HandoverTooLarge, reexec_without_secrets, settle

            try:
                reexec_without_secrets(sys.argv[1:])
            except HandoverTooLarge as error:
                raise BadInput(str(error)) from None
            settle()
        # a process opalctl owns (argv None: the console script, python -m opalctl) may confine itself for an agent
        # arm's run; a caller's process (main(ARGS) from Python, the tests) never is: confinement lasts as long as
        # the process
        cli.main(args=argv, prog_name="opalctl", standalone_mode=False, obj={"own_process": argv is None})
    except Interrupted as error:  # a run stopped by a signal: which one, and what continues it
        sys.stderr.write(f"opalctl: {error.message}\n")
        sys.exit(error.exit_code)
    except OpalctlError as error:
        sys.stderr.write(f"opalctl: error: {error.message}\n" + "".join(f"  {line}\n" for line in error.details))
        sys.exit(error.exit_code)
    except click.exceptions.Abort as error:
        if isinstance(error.__cause__, KeyboardInterrupt):  # click's own word for Ctrl-C outside a run
            sys.stderr.write("opalctl: interrupted (SIGINT)\n")
            sys.exit(EXIT_SIGNALLED + signal.SIGINT)
        sys.stderr.write("opalctl: aborted\n")
        sys.exit(EXIT_FAILURE)
    except click.ClickException as error:
        sys.stderr.write(f"opalctl: error: {error.format_message()}\n")
        sys.exit(EXIT_BAD_INPUT if isinstance(error, click.UsageError) else error.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("opalctl: interrupted (SIGINT)\n")
        sys.exit(EXIT_SIGNALLED + signal.SIGINT)
    except SystemExit:
        raise
    except BaseException as error:  # a bug in opalctl: say so, keep the traceback available
        if os.environ.get("OPALCTL_DEBUG"):
            traceback.print_exc()
        sys.stderr.write(f"opalctl: internal error: {type(error).__name__}: {error} "
                         f"(set OPALCTL_DEBUG=1 to see the traceback)\n")
        sys.exit(EXIT_FAILURE)
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
