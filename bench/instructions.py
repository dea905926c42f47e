"""What does wrapping cost per update, counted in instructions, which the host's noise cannot move?

Timed ratios on this shared 2-core host spread by a few per cent between two identical variants (see
bench/README.md), so they can neither show nor refute a 1 % target. This bench counts the instructions the
training process executes under valgrind's cachegrind (``--cache-sim=no``: instruction counts only), for the
same variants as ``overhead.py`` on pylm: ``bare`` (the torch optimizer) and ``ours`` (``wrap`` with the keep
backend and every default, evaluation-integrity recording on), each trained in its own process.

Start-up (importing torch, building the model, ``wrap``'s set-up and ``close``) is the same whatever the run's
length, so each variant is run at two lengths and the cost of one update is the difference divided by the
difference in updates. Both lengths use the same ``total_steps`` (``--total``, 6,500 as in ``overhead.py``'s
default), so the updates between the two lengths hold the analyses every 25 updates but no decision (the first of
8 falls near update 720): what is counted is the path every update takes. A decision's own cost, 8 times a run,
is ``host_decision.py``'s to measure. ``bare`` is counted
twice, and the two counts' ratio is the noise floor of the method (thread scheduling and allocation still vary a
little from one process to the next). Only the training process is counted: the agent host is a process of its
own, off the training process's clock, as in a formal run.

    python bench/instructions.py [--short 20] [--long 60] [--total 6500] [--json]

Needs valgrind (Debian's ``valgrind``); a run takes several minutes (torch's import alone is about 50 s under
valgrind). Target: ours/bare at most 1.01 instructions per update.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("bare", "ours", "bare-again")  # the noise floor last: the ratio first where time runs short


def child(variant: str, updates: int, total: int, work: Path) -> None:
    """Train ``updates`` updates of pylm with one variant, in this process (the one valgrind counts)."""
    sys.path.insert(0, str(HERE))
    import torch
    from common import prepared
    from overhead import block, make_variant

    torch.manual_seed(0)
    torch.set_num_threads(1)
    task, train, parent, batch_size = prepared(work.parent / "pylm", "pylm")
    # "bare-again" is bare again, counted in a process of its own: the noise floor
    name = "bare" if variant == "bare-again" else variant
    model_optimizer_sampler = make_variant(name, task, train, parent, total, work, batch_size)
    block(task, model_optimizer_sampler, updates, pass_loss=name != "bare")
    close = getattr(model_optimizer_sampler[1], "close", None)
    if callable(close):
        close()


def count(variant: str, updates: int, total: int, scratch: Path) -> int:
    """The instructions one child process executes, from cachegrind's summary line."""
    out = scratch / f"cachegrind.{variant}.{updates}"
    work = scratch / f"work-{variant}-{updates}"
    work.mkdir()
    # threads that spin while they wait execute instructions in proportion to how long the host makes them wait,
    # so OpenMP is told to sleep instead (the first counts, without this, differed by 1.1e9 between two bare runs)
    environment = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                       OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="0")
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
               sys.executable, str(Path(__file__).resolve()), "child", variant, str(updates), str(total), str(work)]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True)
    if finished.returncode != 0:
        raise SystemExit(f"bench/instructions.py: the {variant} run of {updates} updates failed under valgrind "
                         f"(exit {finished.returncode}): {finished.stderr.strip().splitlines()[-1:]}")
    for line in out.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"bench/instructions.py: {out} has no summary line; is this cachegrind's output?")


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        variant, updates, total, work = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
        child(variant, updates, total, work)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=20, help="updates of the shorter run")
    parser.add_argument("--long", type=int, default=60, help="updates of the longer run")
    parser.add_argument("--total", type=int, default=6500, help="the total_steps both runs are wrapped with")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("bench/instructions.py needs valgrind (apt-get install valgrind)")
    if not 0 < args.short < args.long <= args.total:
        raise SystemExit("bench/instructions.py: --short must be positive, below --long, and --long at most --total")
    counts: dict[str, dict[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="opalctl-instructions-") as folder:
        scratch = Path(folder)
        sys.path.insert(0, str(HERE))
        from common import setup

        setup(scratch / "pylm", "pylm")  # the data and the parent, written once outside valgrind
        for variant in VARIANTS:
            counts[variant] = {}
            for updates in (args.short, args.long):
                counts[variant][updates] = count(variant, updates, args.total, scratch)
                print(f"{variant:10s} {updates:4d} updates: {counts[variant][updates]:,} instructions",
                      file=sys.stderr, flush=True)
    per_update = {variant: (counts[variant][args.long] - counts[variant][args.short]) / (args.long - args.short)
                  for variant in VARIANTS}
    ratios = {"ours/bare": per_update["ours"] / per_update["bare"],
              "bare-again/bare": per_update["bare-again"] / per_update["bare"]}
    result = {"bench": "instructions", "task": "pylm", "short": args.short, "long": args.long, "total": args.total,
              "instructions": {variant: {str(k): v for k, v in by_length.items()}
                               for variant, by_length in counts.items()},
              "instructions_per_update": per_update, "ratios": ratios, "targets": {"ours/bare": 1.01}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for variant in VARIANTS:
        print(f"{variant:10s} {per_update[variant]:,.0f} instructions per update")
    for key, value in ratios.items():
        print(f"{key:16s} {value:.4f}")


if __name__ == "__main__":
    main()
