"""``steps.jsonl.gz``: one line per update with the losses read at the flush (kept as detached tensors, or as
numbers), row digests, a running digest, sums handed to the run's totals, and non-finite losses kept; the helper
process that writes them: its errors reach the run as sentences, and it ends with the training process."""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import pytest
import torch

from opalctl.driver.records import SEEN_START, StepsWriter, locate, read_steps
from opalctl.errors import OpalctlError


def expected_lines(batches, losses, seen=SEEN_START):
    out = []
    for ids, loss in zip(batches, losses):
        rows = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]
        seen = hashlib.sha256(f"{seen}:{rows}".encode()).hexdigest()[:32]
        out.append((rows, seen, loss))
    return out


def test_lines_digests_and_sums(tmp_path):
    writer = StepsWriter(tmp_path / "steps.jsonl.gz")
    buffer = np.zeros(4, dtype=np.int64)  # a sampler that reuses its ids array for every batch
    batches, losses = [], []
    weight = torch.nn.Parameter(torch.tensor(2.0))
    for update in range(1, 8):
        buffer[:] = np.arange(4) + 10 * update
        batches.append(buffer.copy())
        loss = weight * update * 0.1
        losses.append(float(loss.detach().double()))
        writer.add(update, 1.0, float(update), 0.001 * update, loss.detach(), buffer.copy())
    sums = writer.take_sums()
    assert sums == {"train_wall": sum(0.001 * u for u in range(1, 8)), "train_cpu": 0.0, "examples": 28,
                    "nonfinite_losses": 0}
    assert writer.take_sums()["examples"] == 0  # handed over once
    writer.close()
    lines = list(read_steps(tmp_path / "steps.jsonl.gz"))
    assert [line["update"] for line in lines] == list(range(1, 8))
    for line, (rows, seen, loss) in zip(lines, expected_lines(batches, losses)):
        assert (line["rows"], line["seen"], line["loss"], line["cpu"]) == (rows, seen, loss, None)
    assert writer.seen == lines[-1]["seen"] and writer.last_loss == losses[-1]


def test_a_non_finite_loss_is_written_counted_and_the_cpu_charge_summed(tmp_path):
    writer = StepsWriter(tmp_path / "steps.jsonl.gz", cpu_charges=True)
    writer.add(1, 0.5, 0.5, 0.6, float("nan"), np.arange(3))
    writer.add(2, 0.25, 0.75, 0.3, float("inf"), np.arange(3))
    writer.add(3, 0.25, 1.0, 0.3, 1.5, np.arange(3))
    sums = writer.take_sums()
    assert sums["nonfinite_losses"] == 2 and sums["train_cpu"] == 1.0
    writer.close()
    lines = list(read_steps(tmp_path / "steps.jsonl.gz"))
    assert math.isnan(lines[0]["loss"]) and lines[1]["loss"] == float("inf") and lines[2]["loss"] == 1.5


def test_a_resumed_writer_cuts_the_file_back_and_continues_the_running_digest(tmp_path):
    path = tmp_path / "steps.jsonl.gz"
    whole = StepsWriter(path)
    for update in range(1, 6):
        whole.add(update, 1.0, float(update), 0.1, 0.5, np.arange(update))
        if update in (2, 3):  # what a checkpoint does: every line so far made durable, the count kept
            whole.begin_sync()
            assert whole.lines == update
            synced = whole.finish_sync(), whole.seen
    whole.close()
    reference = list(read_steps(path))
    assert whole.lines == 5 and synced[1] == reference[2]["seen"]
    offset, seen, _ = locate(path, 3)  # as --resume finds where the checkpoint's lines end
    assert (offset, seen) == synced
    assert locate(path, 0)[:2] == (0, SEEN_START)
    resumed = StepsWriter(path, offset=offset, seen=seen, lines=3)
    for update in range(4, 6):
        resumed.add(update, 1.0, float(update), 0.1, 0.5, np.arange(update))
    resumed.close()
    assert list(read_steps(path)) == reference and resumed.lines == 5 and resumed.seen == whole.seen


def test_lines_a_resume_cannot_find_whole_are_refused_in_one_sentence(tmp_path):
    path = tmp_path / "steps.jsonl.gz"
    writer = StepsWriter(path)
    for update in range(1, 5):
        writer.add(update, 1.0, float(update), 0.1, 0.5, np.arange(3))
        if update == 2:
            writer.begin_sync()  # members end after lines 2 and 4
            writer.finish_sync()
    writer.close()
    whole = path.read_bytes()
    for lines in (3, 5):  # inside a member; past the end of the file
        with pytest.raises(OpalctlError, match=rf"do not end a complete record at line {lines}.*start the run again"):
            locate(path, lines)
    path.write_bytes(whole[:-5])  # the second member cut short: only its first two lines are whole
    assert locate(path, 2)[0] < len(whole) - 5
    with pytest.raises(OpalctlError, match="at line 4"):
        locate(path, 4)
    path.unlink()
    with pytest.raises(OpalctlError, match=r"are missing, and its resume checkpoint counts 4 lines"):
        locate(path, 4)


def test_a_steps_file_that_cannot_be_opened_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(OpalctlError, match=r"steps records .*missing.* cannot be written: No such file"):
        StepsWriter(tmp_path / "missing" / "steps.jsonl.gz")


def test_a_helper_that_dies_is_reported_at_the_next_flush_with_what_to_do(tmp_path):
    writer = StepsWriter(tmp_path / "steps.jsonl.gz")
    writer.add(1, 1.0, 1.0, 0.1, 0.5, np.arange(4))
    writer.begin_sync()
    assert writer.finish_sync() > 0
    writer.process.kill()
    writer.process.wait()
    writer.add(2, 1.0, 2.0, 0.1, 0.5, np.arange(4))
    with pytest.raises(OpalctlError, match=r"stopped \(exit status -9.*--resume"):
        writer.flush()
    assert [line["update"] for line in read_steps(tmp_path / "steps.jsonl.gz")] == [1]


def test_the_helper_ends_with_the_training_process_and_writes_nothing_more(tmp_path):
    """A training process killed with lines sent but never made durable: its helper exits at once (no orphan)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import os, signal, sys, numpy as np\n"
        "from opalctl.driver.records import StepsWriter\n"
        f"writer = StepsWriter({str(tmp_path / 'steps.jsonl.gz')!r})\n"
        "for update in range(1, 4):\n"
        "    writer.add(update, 1.0, float(update), 0.1, 0.5, np.arange(3))\n"
        "writer.begin_sync()\n"
        "offset = writer.finish_sync()\n"
        "writer.add(4, 1.0, 4.0, 0.1, 0.5, np.arange(3))\n"
        "writer.flush()\n"
        "print(writer.process.pid, offset, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    helper, offset = map(int, result.stdout.split())
    for _ in range(200):  # it is not our child: poll for it to be gone
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the steps helper {helper} outlived the training process")
    lines = [line["update"] for line in read_steps(tmp_path / "steps.jsonl.gz")]
    assert lines[:3] == [1, 2, 3] and lines in ([1, 2, 3], [1, 2, 3, 4])  # 4 was sent, never made durable
    assert locate(tmp_path / "steps.jsonl.gz", 3)[0] == offset
    resumed = StepsWriter(tmp_path / "steps.jsonl.gz", offset=offset, lines=3)  # as --resume opens it
    resumed.close()
    assert [line["update"] for line in read_steps(tmp_path / "steps.jsonl.gz")] == [1, 2, 3]


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
def test_a_closed_writer_refuses_more_lines_in_one_sentence_and_closes_twice_quietly(tmp_path, in_process):
    writer = StepsWriter(tmp_path / "steps.jsonl.gz", in_process=in_process)
    writer.add(1, 1.0, 1.0, 0.1, 0.5, np.arange(2))
    writer.close()
    writer.close()
    writer.add(2, 1.0, 2.0, 0.1, 0.5, np.arange(2))
    with pytest.raises(OpalctlError, match="stopped"):
        writer.flush()
    assert [line["update"] for line in read_steps(tmp_path / "steps.jsonl.gz")] == [1]


# --------------------------------------------------------------------------------------------------------------
# the writing end started first, the file opened later (a confined run starts it before the confinement)


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
def test_a_writer_started_first_writes_nothing_until_told_where_the_file_continues(tmp_path, in_process):
    path = tmp_path / "steps.jsonl.gz"
    whole = StepsWriter(path)
    for update in range(1, 6):
        whole.add(update, 1.0, float(update), 0.1, 0.5, np.arange(update))
        if update == 3:
            whole.begin_sync()
            whole.finish_sync()
    whole.close()
    reference = path.read_bytes()
    offset, seen, _ = locate(path, 3)
    path.write_bytes(reference + b"lines a crash left past the checkpoint")
    started = StepsWriter.started(path, in_process=in_process)
    assert path.read_bytes().endswith(b"a crash left past the checkpoint")  # not cut back before it is opened
    started.open(offset, seen, lines=3)
    for update in range(4, 6):
        started.add(update, 1.0, float(update), 0.1, 0.5, np.arange(update))
    started.close()
    assert path.read_bytes() == reference and started.lines == 5 and started.seen == whole.seen


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
@pytest.mark.parametrize("planted", ["link", "second name", "folder"])
def test_what_is_planted_at_the_steps_path_before_it_is_opened_is_refused_and_left_untouched(tmp_path, in_process,
                                                                                          planted):
    path, victim = tmp_path / "training" / "steps.jsonl.gz", tmp_path / "victim.txt"
    path.parent.mkdir()
    victim.write_bytes(b"a file outside the training folder")
    writer = StepsWriter.started(path, in_process=in_process)
    if planted == "link":  # what agent code could do between the start and the open
        path.symlink_to(victim)
    elif planted == "second name":
        os.link(victim, path)
    else:
        path.mkdir()
    with pytest.raises(OpalctlError, match=r"^the run's steps records .*steps.jsonl.gz cannot be written: a link, "
                                           r"a folder or a file with another name too lies there, where the run "
                                           r"writes only a file of its own"):
        writer.open()
    writer.abandon()
    assert victim.read_bytes() == b"a file outside the training folder"


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
def test_the_file_is_opened_once_and_no_line_is_sent_before(tmp_path, in_process):
    from opalctl.driver.records import encode_open

    writer = StepsWriter.started(tmp_path / "steps.jsonl.gz", in_process=in_process)
    writer.add(1, 1.0, 1.0, 0.1, 0.5, np.arange(2))
    with pytest.raises(RuntimeError, match="lines sent before the steps records .* were opened"):
        writer.flush()
    writer.pending.clear()
    writer.open()
    with pytest.raises(RuntimeError, match="are open already"):
        writer.open()
    writer.add(1, 1.0, 1.0, 0.1, 0.5, np.arange(2))
    writer.begin_sync()
    writer.finish_sync()
    writer.channel.send(encode_open(0, SEEN_START))  # as code in the training process could send it
    with pytest.raises(OpalctlError, match="asked to open the file a second time"):
        writer._reply()
    assert [line["update"] for line in read_steps(tmp_path / "steps.jsonl.gz")] == [1]  # not cut back


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
def test_a_writer_closed_before_it_was_opened_ends_quietly_and_writes_nothing(tmp_path, in_process):
    writer = StepsWriter.started(tmp_path / "steps.jsonl.gz", in_process=in_process)
    writer.close()
    assert writer.channel.ended and not (tmp_path / "steps.jsonl.gz").exists()
    if not in_process:
        assert writer.process.returncode == 0


class _Rate(float):
    """A program's number: converting it would run its code."""

    def __float__(self):
        raise AssertionError("the writer ran a program's __float__")


@pytest.mark.parametrize("in_process", [False, True], ids=["helper", "in-process"])
def test_each_lines_learning_rates_are_written_as_kept_and_an_unknown_one_is_null(tmp_path, in_process):
    writer = StepsWriter(tmp_path / "steps.jsonl.gz", in_process=in_process)
    kept = [[1e-3, 2.5e-4], None, [0.1], [], [float("nan"), _Rate(0.5), torch.tensor(0.25), 3]]
    for update, lrs in enumerate(kept, start=1):
        writer.add(update, 1.0, float(update), 0.1, 0.5, np.arange(update), lrs)
    writer.add(6, 1.0, 6.0, 0.1, 0.5, np.arange(2))  # as an older caller: no learning rates
    writer.close()
    lines = list(read_steps(tmp_path / "steps.jsonl.gz"))
    assert [line["lrs"] for line in lines] == [[1e-3, 2.5e-4], None, [0.1], [], [None, None, 0.25, 3.0], None]
    assert [line["rows"] for line in lines] == [hashlib.sha256(np.arange(u, dtype=np.int64).tobytes()).hexdigest()[:16]
                                                for u in (1, 2, 3, 4, 5, 2)], "the ids still come through whole"
