"""The bounds on an agent arm's confined training process (opalctl/sandbox.py), and on what it leaves in its
folder of the run (opalctl/training_folder.py).

One child process runs every probe twice, before and after ``confine_process(..., bounds=...)``, as
tests/test_sandbox.py does: a probe refused only after is refused by the bounds. In the middle it stops, and this
process reads the kernel's view of it and of its steps helper from ``/proc`` (threads, seccomp, capabilities),
which the child itself can no longer read. The calls that would wreck the child if they were allowed (a raw
vfork, an execve) come last, after it has printed everything else. Where seccomp is missing (not Linux, another
architecture) the tests skip as needing a system component (CI fails such a skip: tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opalctl import sandbox
from opalctl.layout import RunLayout
from opalctl.protocol.schema import Limits
from opalctl.sandbox import SYSCALLS, bound_refusal, memory_bound, process_filter, training_bounds
from opalctl.training_folder import clear_strays, training_folder_bytes, training_folder_excess
from tests import support

SYSTEM_SKIP = "needs a system component:"
MiB = 1 << 20
FILE_BOUND = 1 * MiB
MEMORY_ROOM = 768 * MiB  # the memory bound is what the child uses at confinement plus this

SCENARIO = r'''
import ctypes, errno, json, mmap, multiprocessing, os, resource, subprocess, sys, threading
from pathlib import Path

import torch

from opalctl.driver.records import StepsWriter, read_steps
from opalctl.sandbox import Bounds, bound_refusal, confine_process, training_paths

given = json.loads(sys.argv[1])
training = Path(given["training"])
results = {}
X86 = os.uname().machine == "x86_64"
CLONE, CLONE3 = (56, 435) if X86 else (220, 435)  # syscall_64.tbl; asm-generic/unistd.h
SIGCHLD, X32_GETPID, I386_GETPID = 17, 0x40000000 | 39, 20
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def probe(name, action):
    try:
        value = action()
        results[name] = "ok" if value is None else value
    except OSError as error:
        results[name] = errno.errorcode.get(error.errno, str(error.errno))
    except Exception as error:  # MemoryError, torch's RuntimeError, ValueError
        results[name] = f"{type(error).__name__}: {error}"[:300]


def threads_now():
    return int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])


def raw(number, *args):
    ctypes.set_errno(0)
    answer = libc.syscall(ctypes.c_long(number), *args)
    if answer < 0:
        raise OSError(ctypes.get_errno(), "refused")
    return answer


def forked(pid):
    if pid == 0:  # the child of a call that should have been refused: gone at once
        os._exit(0)
    os.waitpid(pid, 0)


class CloneArgs(ctypes.Structure):  # include/uapi/linux/sched.h, CLONE_ARGS_SIZE_VER0
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls")]


class Rlimit(ctypes.Structure):
    _fields_ = [("soft", ctypes.c_ulong), ("hard", ctypes.c_ulong)]


def raise_data_limit():
    """setrlimit through the C library, so the kernel's errno shows (Python turns EPERM into ValueError)."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    wanted = Rlimit(hard + (1 << 20), hard + (1 << 20))
    if libc.setrlimit(resource.RLIMIT_DATA, ctypes.byref(wanted)) != 0:
        raise OSError(ctypes.get_errno(), "refused")


def i386_getpid():
    """getpid through the i386 ABI (int 0x80), which a 64-bit process on x86_64 can still call."""
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes([0xB8, I386_GETPID, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20; int 0x80; ret
    answer = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    if answer < 0:
        raise OSError(-answer, "refused")
    assert answer == os.getpid(), answer


def give_away(when):
    """chown to another user: CAP_CHOWN's, which Landlock does not refuse."""
    path = training / f"chown-{when}"
    path.write_text("x")
    os.chown(path, 1, 1)


def a_thread():
    seen = []
    worker = threading.Thread(target=lambda: seen.append(threading.get_native_id()))
    worker.start()
    worker.join()
    assert seen and seen[0] != threading.get_native_id()


def system(when):
    marker = training / f"system-{when}"
    status = os.system(f"touch {marker}")
    return "ok" if status == 0 and marker.exists() else f"status {status}"


def probes(when):
    probe(f"{when}.fork", lambda: forked(os.fork()))
    probe(f"{when}.popen", lambda: subprocess.run(["true"], check=True) and None)
    probe(f"{when}.posix_spawn", lambda: os.waitpid(os.posix_spawn("/bin/true", ["true"], os.environ), 0) and None)
    probe(f"{when}.multiprocessing", lambda: (lambda p: (p.start(), p.join()))(
        multiprocessing.Process(target=os._exit, args=(0,))) and None)
    probe(f"{when}.system", lambda: system(when))
    probe(f"{when}.clone", lambda: forked(raw(CLONE, *[ctypes.c_ulong(v) for v in (SIGCHLD, 0, 0, 0, 0)])))
    probe(f"{when}.clone3", lambda: forked(raw(CLONE3, ctypes.byref(CloneArgs(exit_signal=SIGCHLD)),
                                               ctypes.c_size_t(ctypes.sizeof(CloneArgs)))))
    if X86:
        probe(f"{when}.x32", lambda: raw(X32_GETPID) and None)
        if given["i386"]:
            probe(f"{when}.i386", i386_getpid)
    probe(f"{when}.raise_limit", raise_data_limit)
    probe(f"{when}.chown", lambda: give_away(when))
    probe(f"{when}.thread", a_thread)


steps = StepsWriter.started(training / "steps.jsonl.gz", confine=True)  # before: no process starts afterwards
asked, answered = threading.Event(), threading.Event()


def elder_thread():
    """A thread running before confinement: it keeps its capabilities, the filter still reaches it."""
    asked.wait()
    probe("elder_thread.set_limit", set_same_limit)
    answered.set()


def set_same_limit():
    """setrlimit of RLIMIT_RTPRIO to the values it has (allowed to anyone), through the C library for its errno."""
    soft, hard = resource.getrlimit(resource.RLIMIT_RTPRIO)
    if libc.setrlimit(resource.RLIMIT_RTPRIO, ctypes.byref(Rlimit(soft, hard))) != 0:
        raise OSError(ctypes.get_errno(), "refused")


elder = threading.Thread(target=elder_thread)
elder.start()
probe("before.set_limit", set_same_limit)
results["threads_before"] = threads_now()  # torch is imported and has not run: its pool is not started yet
try:
    resource.setrlimit(resource.RLIMIT_DATA, (1 << 42, 1 << 42))  # lowered, so that raising it can be tried
except (ValueError, OSError):
    pass
probes("before")
memory_bound = int(given["room"]) + int(next(line for line in open("/proc/self/status")
                                             if line.startswith("VmData:")).split()[1]) * 1024
bounds = Bounds(memory_bytes=memory_bound, file_bytes=given["file_bound"], no_processes=True,
                drop_capabilities=True, memory_rule="the test's", file_rule="the test's")
results["confinement"] = confine_process(writable=[training], readable=training_paths(), bounds=bounds).to_json()
probes("after")
asked.set()
answered.wait()
probe("get_limit", lambda: resource.getrlimit(resource.RLIMIT_DATA)[0])

steps.open()
for update in range(1, 4):
    steps.add(update, 1.0, float(update), 0.001, 0.5, list(range(update)))
steps.begin_sync()
probe("steps_synced", lambda: steps.finish_sync() > 0 or "nothing written")
torch.set_num_threads(3)  # two workers beside this thread
probe("matmul", lambda: float((torch.ones(1500, 1500) @ torch.ones(1500, 1500))[0, 0]))
print("PAUSE " + json.dumps({"helper": steps.process.pid}), flush=True)
sys.stdin.readline()  # the test reads /proc meanwhile

try:
    bytearray(memory_bound)
    results["memory.python"] = "ok"
except MemoryError as error:
    results["memory.python"] = "MemoryError"
    refusal = bound_refusal(error, "resume with: opalctl run L --arm agent --seed 1 --resume")
    results["memory.refusal"] = refusal.message if refusal else None
probe("memory.torch", lambda: torch.empty(memory_bound, dtype=torch.uint8) and None)
probe("memory.shared_mapping", lambda: mmap.mmap(-1, memory_bound).close())  # not counted (never touched here)
probe("memory.lives_on", lambda: len(bytearray(32 << 20)) == 32 << 20 and float(torch.ones(64).sum()))
try:
    (training / "past-the-bound.bin").write_bytes(b"x" * (2 * given["file_bound"]))
    results["file.past"] = "ok"
except OSError as error:
    results["file.past"] = errno.errorcode[error.errno]
    refusal = bound_refusal(error, "resume with: opalctl run L --arm agent --seed 1 --resume")
    results["file.refusal"] = refusal.message if refusal else None
results["file.past_size"] = (training / "past-the-bound.bin").stat().st_size
probe("file.within", lambda: (training / "within.bin").write_bytes(b"x" * (given["file_bound"] // 2)) and None)
steps.close()
results["steps_lines"] = [line["update"] for line in read_steps(training / "steps.jsonl.gz")]
print("RESULTS " + json.dumps(results), flush=True)

last = {}
if X86:  # a raw vfork: were it allowed, its child would run on this process's stack
    try:
        forked(raw(58))
        last["vfork"] = "ok"
    except OSError as error:
        last["vfork"] = errno.errorcode[error.errno]
print("LAST " + json.dumps(last), flush=True)
try:
    os.execv("/bin/true", ["true"])  # were it allowed, this process would end here, printing nothing more
except OSError as error:
    print("EXECVE " + errno.errorcode[error.errno], flush=True)
'''

I386_CHECK = r'''
import ctypes, mmap, os
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))() == os.getpid())
'''


def status_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    """The scenario's results, before and after confinement, and /proc's view of the child and its helper."""
    if sys.platform != "linux" or os.uname().machine not in SYSCALLS:
        pytest.skip(f"{SYSTEM_SKIP} seccomp on x86_64 or aarch64 Linux (this is {sys.platform} "
                    f"{os.uname().machine if hasattr(os, 'uname') else ''})")
    training = tmp_path_factory.mktemp("bounded") / "runs" / "agent" / "seed-1" / "training"
    training.mkdir(parents=True)
    i386 = os.uname().machine == "x86_64" and subprocess.run(
        [sys.executable, "-c", I386_CHECK], capture_output=True, text=True, timeout=60).stdout.strip() == "True"
    given = {"training": str(training), "room": MEMORY_ROOM, "file_bound": FILE_BOUND, "i386": i386}
    stderr_path = training.parent / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", SCENARIO, json.dumps(given)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            seen = {}
            for line in child.stdout:
                if line.startswith("PAUSE "):
                    helper = json.loads(line[len("PAUSE "):])["helper"]
                    seen = {"child": status_of(child.pid), "helper": status_of(helper)}
                    child.stdin.write("\n")
                    child.stdin.flush()
                    break
            out, _ = child.communicate(timeout=300)
        finally:
            child.kill()
            child.wait()
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert seen and "RESULTS" in lines, stderr_path.read_text()[-3000:]
    results = json.loads(lines["RESULTS"])
    results.update({f"last.{key}": value for key, value in json.loads(lines.get("LAST", "{}")).items()})
    results["execve"] = lines.get("EXECVE", "the process was replaced")
    results["proc"], results["given"], results["returncode"] = seen, given, child.returncode
    return results


def refused_only_after(results, probe: str, refused: str = "EPERM") -> None:
    assert results[f"before.{probe}"] == "ok", (probe, results[f"before.{probe}"])
    assert results[f"after.{probe}"] == refused, (probe, results[f"after.{probe}"])


# --------------------------------------------------------------------------------------------------------------
# processes


def test_each_bound_is_applied_and_recorded(bounded):
    record = bounded["confinement"]["bounds"]
    assert record["not_applied"] == {}, record["not_applied"]
    assert record["processes"] == "none allowed"
    assert record["capabilities"] in ("all dropped", "none held")
    assert record["file_bytes"] == FILE_BOUND and record["memory_rule"] == "the test's"
    assert record["memory_bytes"] == record["data_bytes_at_confinement"] + MEMORY_ROOM
    assert json.loads(json.dumps(bounded["confinement"])) == bounded["confinement"]


@pytest.mark.parametrize("probe", ["fork", "popen", "posix_spawn", "multiprocessing", "clone"])
def test_no_process_can_be_started_after_confinement(bounded, probe):
    refused_only_after(bounded, probe)


def test_os_system_starts_nothing_after_confinement(bounded):
    assert bounded["before.system"] == "ok"
    assert bounded["after.system"] != "ok"
    assert not (Path(bounded["given"]["training"]) / "system-after").exists()


def test_clone3_answers_enosys_so_that_threads_fall_back_to_clone(bounded):
    refused_only_after(bounded, "clone3", "ENOSYS")


def test_a_raw_vfork_and_execve_are_refused(bounded):
    if os.uname().machine == "x86_64":
        assert bounded["last.vfork"] == "EPERM"
    assert bounded["execve"] == "EPERM"
    assert bounded["returncode"] == 0


def test_the_other_abis_of_x86_64_are_refused_whole(bounded):
    if os.uname().machine != "x86_64":
        pytest.skip("the i386 and x32 ABIs are x86_64's")
    assert bounded["before.x32"] in ("ok", "ENOSYS") and bounded["after.x32"] == "EPERM"
    if not bounded["given"]["i386"]:
        pytest.skip("this kernel runs no i386 system calls (no IA32 emulation)")
    refused_only_after(bounded, "i386")


def test_threads_still_start_python_ones_and_torchs_intra_op_pool(bounded):
    assert bounded["before.thread"] == "ok" and bounded["after.thread"] == "ok"
    assert bounded["matmul"] == 1500.0
    # torch's pool of three started after the filter: the kernel counts its two workers more than before
    assert int(bounded["proc"]["child"]["Threads"]) >= bounded["threads_before"] + 2


def test_the_kernel_holds_the_child_to_the_filter_on_every_thread_with_no_capability(bounded):
    child = bounded["proc"]["child"]
    assert child["Seccomp"] == "2" and child["NoNewPrivs"] == "1"
    assert int(child["CapEff"], 16) == int(child["CapPrm"], 16) == int(child["CapInh"], 16) == 0
    assert int(child["CapBnd"], 16) == 0 or os.geteuid() != 0  # only root may clear its bounding set


def test_the_steps_helper_started_before_confinement_confines_itself_and_keeps_writing(bounded):
    helper = bounded["proc"]["helper"]
    assert helper["Seccomp"] == "2" and helper["NoNewPrivs"] == "1" and int(helper["CapEff"], 16) == 0
    assert isinstance(bounded["steps_synced"], bool) and bounded["steps_synced"]
    assert bounded["steps_lines"] == [1, 2, 3]


# --------------------------------------------------------------------------------------------------------------
# capabilities, memory, files


def test_the_limits_cannot_be_raised_again_once_the_capabilities_are_dropped(bounded):
    assert bounded["after.raise_limit"] == "EPERM"
    if bounded["before.raise_limit"] != "ok":
        pytest.skip(f"this process could not raise its limits before either ({bounded['before.raise_limit']}: root "
                    f"without CAP_SYS_RESOURCE, or not root)")
    refused_only_after(bounded, "raise_limit")


def test_no_limit_can_be_set_after_confinement_even_by_a_thread_that_kept_its_capabilities(bounded):
    assert bounded["before.set_limit"] == "ok"  # setting a limit to its own values...
    assert bounded["elder_thread.set_limit"] == "EPERM"  # ...refused once confined
    assert bounded["confinement"]["bounds"]["limits_fixed"] is True
    assert bounded["get_limit"] == bounded["confinement"]["bounds"]["memory_bytes"]  # reading one still works


def test_what_a_capability_allowed_before_confinement_is_refused_after(bounded):
    if bounded["before.chown"] != "ok":
        pytest.skip(f"this process holds no CAP_CHOWN to drop ({bounded['before.chown']})")
    refused_only_after(bounded, "chown")


def test_an_allocation_past_the_memory_bound_fails_and_the_process_lives_on(bounded):
    assert bounded["memory.python"] == "MemoryError"
    assert bounded["memory.torch"].startswith("RuntimeError") and "can't allocate memory" in bounded["memory.torch"]
    assert bounded["memory.lives_on"] == 64.0
    # what RLIMIT_DATA does not count, and the module docstring says so: a shared mapping
    assert bounded["memory.shared_mapping"] == "ok"


def test_reaching_the_memory_bound_outside_the_programs_is_one_sentence_with_the_command_that_resumes(bounded):
    sentence = bounded["memory.refusal"]
    assert sentence.startswith("the training process reached its memory bound of ")
    assert "(the test's) outside the agent's programs (MemoryError); resume with: opalctl run L --arm agent " \
           "--seed 1 --resume, on a machine with more memory if limits.memory_bytes is auto, or freeze the " \
           "protocol again with a larger limits.memory_bytes" in sentence


def test_a_write_past_the_file_bound_fails_with_efbig_and_the_process_lives_on(bounded):
    assert bounded["file.past"] == "EFBIG" and bounded["file.past_size"] == FILE_BOUND
    assert bounded["file.within"] == "ok"
    assert bounded["file.refusal"] == (
        "a file the training process wrote reached its bound on one file of 1.0 MiB (the test's): File too large; "
        "resume with: opalctl run L --arm agent --seed 1 --resume, or freeze the protocol again with a larger "
        "limits.checkpoint_bytes")


def test_a_process_without_bounds_classifies_nothing_as_a_bound():
    assert bound_refusal(MemoryError(), "resume") is None
    assert bound_refusal(OSError(27, "File too large"), "resume") is None


# --------------------------------------------------------------------------------------------------------------
# where a bound cannot be set: recorded, with the reason, and nothing else changed

UNKNOWN_ARCHITECTURE = r'''
import json, os
import opalctl.sandbox as sandbox

sandbox.SYSCALLS.clear()  # as on an architecture no filter is written for
record = sandbox.confine_process(writable=[], readable=sandbox.training_paths(),
                                 bounds=sandbox.Bounds(no_processes=True)).to_json()["bounds"]
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps(record))
'''


def test_without_a_filter_for_the_architecture_processes_stay_possible_and_the_record_says_why():
    child = subprocess.run([sys.executable, "-c", UNKNOWN_ARCHITECTURE], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    record = json.loads(child.stdout)
    assert record["processes"] is None
    assert record["not_applied"] == {"processes": f"no seccomp filter is written for this architecture "
                                                  f"({os.uname().machine}, a 64-bit Python); new processes stay "
                                                  f"possible"}


def test_the_filter_of_each_architecture_assembles_to_jumps_that_land_inside_it():
    for machine, calls in SYSCALLS.items():
        program = process_filter(calls)
        assert len(program) < 64, machine
        for index, (code, true, false, _) in enumerate(program):
            if code & 0x07 == 0x05:  # BPF_JMP: both targets inside the program
                assert index + 1 + max(true, false) < len(program), (machine, index)
        assert program[-1][0] == 0x06 and program[-1][3] == sandbox.SECCOMP_RET_ERRNO | 38  # ENOSYS for clone3
        refused = [instruction[3] for instruction in program if instruction[0] == 0x15]
        assert set(calls.refused) <= set(refused) and calls.clone in refused and calls.clone3 in refused


# --------------------------------------------------------------------------------------------------------------
# the bounds a protocol gives


def test_the_bounds_of_a_protocol_and_how_each_auto_resolves():
    limits = Limits()
    assert (limits.memory_bytes, limits.training_folder_bytes) == ("auto", "auto")
    bounds = training_bounds(limits, stages=4)
    machine, source = sandbox.machine_memory()
    assert bounds.memory_bytes == machine * 3 // 4 and source in bounds.memory_rule
    assert bounds.file_bytes == 2 << 30 and bounds.no_processes and bounds.drop_capabilities
    assert bounds.folder_bytes == 6 * (2 << 30) + (1 << 30)
    small = Limits(checkpoint_bytes=4096, memory_bytes=1 << 30, training_folder_bytes=5 << 20)
    assert training_bounds(small, stages=2, ranks=2).memory_bytes == 1 << 30  # a number is taken as it is
    assert training_bounds(small, stages=2).file_bytes == 1 << 30  # never below 1 GiB: the log, the records
    assert training_folder_bytes(small, 2) == (5 << 20, "limits.training_folder_bytes")
    assert memory_bound("auto", ranks=4)[0] == machine * 3 // 4 // 4
    assert "shared by 4 ranks" in memory_bound("auto", ranks=4)[1]
    assert 0 < machine <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --------------------------------------------------------------------------------------------------------------
# the training folder


def a_run_folder(root: Path) -> RunLayout:
    """A run folder whose training/ holds one of everything the run writes there."""
    layout = RunLayout(root / "runs" / "digits-0123456789ab" / "agent" / "seed-1")
    layout.training.mkdir(parents=True)
    layout.start.write_text("{}")
    files = {"stage-01.pt": 4096, "stage-02.pt": 4096, "resume.pt": 4096, "steps.jsonl.gz": 512,
             "opal/events.jsonl": 100, "opal/losses.jsonl": 100, "opal/reports.jsonl": 100, "opal/hung.jsonl": 10,
             "opal/programs/v000/updater.py": 50, "opal/programs/v000/analysis.py": 50,
             "opal/programs/v001/updater.py": 50, "opal/decisions/001/message.md": 50,
             "opal/decisions/001/response.md": 50, "opal/decisions/001/meta.json": 50,
             "opal/decisions/001/transcript.json": 50, "opal/workspace/updater.py": 50,
             "opal/workspace/notes/anything.txt": 50}
    for name, size in files.items():
        path = layout.training / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return layout


def test_a_stray_file_past_the_folder_bound_is_one_sentence_that_a_resume_clears(tmp_path):
    layout = a_run_folder(tmp_path)
    assert training_folder_excess(layout, 10 * MiB) is None
    (layout.training / "cache.bin").write_bytes(b"\1" * (50 * MiB))
    sentence = training_folder_excess(layout, 10 * MiB)
    assert sentence.startswith("the training process uses 50.") and f"of disk in {layout.training}, past " \
        f"limits.training_folder_bytes (10.0 MiB; the largest: training/cache.bin 50.0 MiB, " in sentence
    assert sentence.endswith("; resume the run with --resume, which first removes the 50.0 MiB the run itself did "
                             "not write there")
    assert clear_strays(layout) == ["training/cache.bin"]
    assert training_folder_excess(layout, 10 * MiB) is None


def test_when_the_runs_own_files_pass_the_folder_bound_the_sentence_asks_for_a_larger_one(tmp_path):
    layout = a_run_folder(tmp_path)
    (layout.training / "resume.pt").write_bytes(b"\1" * (3 * MiB))
    sentence = training_folder_excess(layout, 2 * MiB)
    assert sentence.endswith("so freeze the protocol again with a larger limits.training_folder_bytes"), sentence


def test_the_folder_is_measured_in_blocks_used_links_unfollowed_and_each_file_once(tmp_path):
    layout = a_run_folder(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\1" * (20 * MiB))
    (layout.training / "link-out").symlink_to(outside)
    (layout.training / "opal" / "workspace" / "link-to-a-folder").symlink_to(tmp_path)  # kept whole, not entered
    with open(layout.training / "sparse.bin", "wb") as sparse:
        sparse.truncate(1 << 40)  # a terabyte long, no block used
    big = layout.training / "stage-03.pt"
    big.write_bytes(b"\1" * (6 * MiB))
    for number in range(4):
        os.link(big, layout.training / f"again-{number}")
    assert training_folder_excess(layout, 7 * MiB) is None
    assert training_folder_excess(layout, 5 * MiB) is not None


def test_folders_nested_past_what_can_be_measured_are_one_sentence_that_a_resume_clears(tmp_path):
    layout = a_run_folder(tmp_path)
    deep = layout.training / "nest"
    for _ in range(70):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "hidden.bin").write_bytes(b"\1" * MiB)
    sentence = training_folder_excess(layout, 1 << 40)
    assert sentence.startswith(f"the training process made folders nested more than 64 deep in {layout.training} "
                               f"(training/nest/d/d/")
    assert sentence.endswith("resume the run with --resume, which first removes what the run itself did not write "
                             "there")
    assert clear_strays(layout) == ["training/nest"] and training_folder_excess(layout, 1 << 40) is None


def test_clear_strays_keeps_the_runs_own_files_and_removes_the_rest(tmp_path):
    layout = a_run_folder(tmp_path)
    kept = {path: path.read_bytes() for path in layout.training.rglob("*") if path.is_file()}
    strays = ["cache.bin", ".resume.pt.abc123.tmp", "stage-1.pt", "notes/a/b/c.txt", "opal/junk.bin",
              "opal/programs/v001/evil.so", "opal/programs/scratch/updater.py", "opal/decisions/001/extra.md",
              "opal/decisions/last/meta.json"]
    for name in strays:
        (layout.training / name).parent.mkdir(parents=True, exist_ok=True)
        (layout.training / name).write_bytes(b"stray")
    os.mkfifo(layout.training / "pipe")
    (layout.training / "link").symlink_to(layout.start)
    (layout.training / "resume.pt").unlink()
    (layout.training / "resume.pt").symlink_to(tmp_path / "elsewhere.pt")  # the run's name, but a link
    (tmp_path / "elsewhere.pt").write_bytes(b"not the run's")
    (layout.training / "steps.jsonl.gz").unlink()
    (layout.training / "steps.jsonl.gz").mkdir()  # the run's name, but a folder
    (layout.training / "steps.jsonl.gz" / "inside").write_bytes(b"x")
    removed = clear_strays(layout)
    assert removed == sorted(f"training/{name}" for name in (
        "cache.bin", ".resume.pt.abc123.tmp", "stage-1.pt", "notes", "opal/junk.bin", "opal/programs/v001/evil.so",
        "opal/programs/scratch", "opal/decisions/001/extra.md", "opal/decisions/last", "pipe", "link", "resume.pt",
        "steps.jsonl.gz"))
    del kept[layout.training / "resume.pt"], kept[layout.training / "steps.jsonl.gz"]
    assert {path: path.read_bytes() for path in layout.training.rglob("*") if path.is_file()} == kept
    assert layout.start.exists() and (tmp_path / "elsewhere.pt").read_bytes() == b"not the run's"
    assert clear_strays(layout) == []


def test_clear_strays_removes_nothing_from_a_folder_made_before_training_existed(tmp_path):
    root = tmp_path / "runs" / "digits-0123456789ab" / "agent" / "seed-1"
    root.mkdir(parents=True)
    for name in ("start.json", "resume.pt", "stage-01.json", "grid.log", "cache.bin"):
        (root / name).write_text("x")
    layout = RunLayout(root)
    assert layout.legacy and clear_strays(layout) == []
    assert sorted(path.name for path in root.iterdir()) == ["cache.bin", "grid.log", "resume.pt", "stage-01.json",
                                                            "start.json"]


def test_clear_strays_removes_nothing_from_what_a_real_agent_run_wrote(finished_runs, tmp_path):
    source = finished_runs["base"] / "agent" / "seed-1"
    copy = tmp_path / "seed-1"
    shutil.copytree(source, copy, symlinks=True)
    layout = RunLayout(copy)
    assert not layout.legacy and (layout.opal / "events.jsonl").is_file() and layout.stage_checkpoint(4).is_file()
    assert list((layout.opal / "decisions").glob("*/meta.json")) and list((layout.opal / "programs").glob("v*/*.py"))
    before = support.tree(copy)
    assert clear_strays(layout) == []
    assert support.tree(copy) == before
