"""``confine_process`` in a real child process: what it can still do after confinement, and what it no longer can.

One child runs every probe twice, before and after it confines itself, and prints what each one gave (``ok`` or
the errno's name); a probe refused only after is refused by the confinement, not by the test's setup. The child
starts a grandchild after confinement, which runs the same probes without confining itself. Where the kernel has
no Landlock the tests skip as needing a system component, with the kernel's reason (CI, which sets
``OPALCTL_REQUIRE_SYSTEM=1`` on a kernel that has it, fails them instead: tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import opalctl
from opalctl.sandbox import DeviceAccess, confine_process, device_access, training_paths

SCENARIO = r'''
import errno, json, os, socket, subprocess, sys, threading
from pathlib import Path

given = json.loads(sys.argv[1])
run, outside, data = Path(given["run"]), Path(given["outside"]), Path(given["data"])
results = {}


def probe(name, action):
    try:
        action()
        results[name] = "ok"
    except OSError as error:
        results[name] = errno.errorcode.get(error.errno, str(error.errno))
    except Exception as error:
        results[name] = f"{type(error).__name__}: {error}"


def connect():
    socket.create_connection(("127.0.0.1", given["tcp_port"]), timeout=5).close()


def bind():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))


def udp():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"probe", ("127.0.0.1", given["udp_port"]))


def abstract_unix():
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(given["abstract"].encode("latin-1"))


def run_written(when):
    script = run / f"written-{when}.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    subprocess.run([str(script)], check=True)


def mknod(when):
    os.mknod(run / f"null-{when}", 0o600 | 0o020000, os.makedev(1, 3))  # a character device like /dev/null


def write_inside(when):
    import torch

    folder = run / f"stage-{when}"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "state.tmp")
    os.replace(folder / "state.tmp", folder / "state.pt")  # how opalctl writes a file atomically
    assert torch.load(folder / "state.pt")["w"].sum().item() == 3.0
    with open(folder / "log.txt", "w") as log:
        log.write("first")
    with open(folder / "log.txt", "r+") as log:
        log.truncate(0)
    (folder / "log.txt").unlink()
    with open(os.devnull, "w") as null:
        null.write("discarded")


def train_torch():
    import torch

    torch.nn.Linear(3, 1)(torch.ones(2, 3)).sum().backward()


def in_a_new_thread(action):
    """``action`` in a thread started now (as the CUDA driver starts them after confinement), its error raised."""
    import threading

    failed = []
    thread = threading.Thread(target=lambda: _catching(action, failed))
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _catching(action, failed):
    try:
        action()
    except OSError as error:
        failed.append(error)


def name_this_thread():  # as the driver does: fopen(".../comm", "w"), which truncates
    handle = os.open(f"/proc/self/task/{threading.get_native_id()}/comm", os.O_WRONLY | os.O_TRUNC)
    os.write(handle, b"opal-probe")
    os.close(handle)


def read_this_threads_environ():
    Path(f"/proc/self/task/{threading.get_native_id()}/environ").read_bytes()


def probes(when):
    probe(f"{when}.connect", connect)
    probe(f"{when}.bind", bind)
    probe(f"{when}.udp", udp)
    probe(f"{when}.abstract_unix", abstract_unix)
    probe(f"{when}.run_written", lambda: run_written(when))
    probe(f"{when}.write_outside", lambda: (outside / f"{when}.txt").write_text("x"))
    probe(f"{when}.read_data", data.read_bytes)
    probe(f"{when}.read_beside_package", lambda: Path(given["beside_package"]).read_bytes())
    probe(f"{when}.write_inside", lambda: write_inside(when))
    probe(f"{when}.mknod", lambda: mknod(when))
    probe(f"{when}.signal_elder", lambda: os.kill(given["elder"], 0))
    probe(f"{when}.elder_environ", lambda: Path(f"/proc/{given['elder']}/environ").read_bytes())
    probe(f"{when}.own_environ", lambda: Path("/proc/self/environ").read_bytes())
    probe(f"{when}.device_written", lambda: os.close(os.open(given["device"], os.O_WRONLY)))
    probe(f"{when}.thread_named", lambda: in_a_new_thread(name_this_thread))
    probe(f"{when}.thread_environ", lambda: in_a_new_thread(read_this_threads_environ))


if given.get("role") == "grandchild":  # confined from its first instruction: torch is imported under Landlock
    results["inherited.torch_loaded_before"] = "torch" in sys.modules
    probe("inherited.train_torch", train_torch)
    probes("inherited")
else:
    probes("before")
    results["minidom_loaded_before"] = "xml.dom.minidom" in sys.modules
    from opalctl.sandbox import confine_process, training_paths

    from opalctl.sandbox import DeviceAccess

    own_tasks = Path(f"/proc/{os.getpid()}/task")  # as device_access names them on CUDA
    results["confinement"] = confine_process(
        writable=[run], readable=training_paths(),
        devices=DeviceAccess(nodes=(Path(given["device"]),), thread_names=(own_tasks,))).to_json()
    results["confined_pid"] = os.getpid()
    probes("after")
    probe("import_minidom", lambda: __import__("xml.dom.minidom").dom.minidom.parseString("<a/>"))
    probe("train_torch", train_torch)
    grandchild = subprocess.run([sys.executable, "-c", given["source"], json.dumps({**given, "role": "grandchild"})],
                                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    results["grandchild_stderr"] = grandchild.stderr[-2000:]
    results.update(json.loads(grandchild.stdout or "{}"))
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Run the scenario once for the module: the results of every probe, before and after confinement."""
    root = tmp_path_factory.mktemp("sandbox")
    run, outside, project = root / "runs" / "arm" / "seed-1", root / "outside", root / "project"
    for folder in (run, outside, project / "data"):
        folder.mkdir(parents=True)
    data = project / "data" / "selection.npz"
    data.write_bytes(b"the evaluation split the training process must not read")
    device = outside / "device"  # granted as a device node is (a GPU's, on CUDA): opened for writing after too
    device.write_bytes(b"")
    import_root = Path(opalctl.__file__).resolve().parent.parent
    beside = next((p for p in sorted(import_root.iterdir()) if p.is_file()), data)
    abstract = f"\0opalctl-sandbox-test-{os.getpid()}"
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
            socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        udp.bind(("127.0.0.1", 0))
        unix.bind(abstract.encode("latin-1"))
        unix.listen(8)
        elder = subprocess.Popen(["sleep", "120"], env={**os.environ, "OPALCTL_TEST_SECRET": "sk-elder-secret"})
        try:
            given = {"run": str(run), "outside": str(outside), "data": str(data), "beside_package": str(beside),
                     "abstract": abstract, "tcp_port": tcp.getsockname()[1], "udp_port": udp.getsockname()[1], "elder": elder.pid,
                     "device": str(device), "source": SCENARIO}
            child = subprocess.run([sys.executable, "-c", SCENARIO, json.dumps(given)], cwd=project,
                                   capture_output=True, text=True, timeout=180,
                                   env={**os.environ, "OPALCTL_TEST_SECRET": "sk-child-secret"})
        finally:
            elder.kill()
            elder.wait()
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout)
    confinement = results["confinement"]
    if confinement["mechanism"] == "none":
        pytest.skip(f"needs a system component: Landlock ({confinement['reason']})")
    results["given"] = given
    return results


def assert_refused_only_after(results, probe: str, refused: tuple[str, ...] = ("EACCES",)):
    assert results[f"before.{probe}"] == "ok", results[f"before.{probe}"]
    assert results[f"after.{probe}"] in refused, results[f"after.{probe}"]


def test_the_child_is_confined_by_landlock_with_every_right_of_the_kernels_abi(probed):
    confinement = probed["confinement"]
    assert confinement["mechanism"] == "landlock" and confinement["abi"] >= 4, confinement
    assert confinement["network_denied"] is True
    assert confinement["writable"] == [probed["given"]["run"]]
    project = Path(probed["given"]["data"]).parents[1]
    assert not any(Path(path) == project or project.is_relative_to(path) or Path(path).is_relative_to(project)
                   for path in confinement["readable"] + confinement["listable"])
    assert json.loads(json.dumps(confinement)) == confinement


def test_a_tcp_connect_to_a_loopback_server_is_refused(probed):
    assert_refused_only_after(probed, "connect")


def test_a_tcp_bind_is_refused(probed):
    assert_refused_only_after(probed, "bind")


def test_udp_reaches_nothing_once_the_process_has_its_own_network_namespace(probed):
    if probed["confinement"]["reason"] and "UDP" in probed["confinement"]["reason"]:
        pytest.skip(f"not stopped here, and recorded so: {probed['confinement']['reason']}")
    assert_refused_only_after(probed, "udp", ("ENETUNREACH",))


def test_an_abstract_unix_socket_of_another_process_is_refused(probed):
    if probed["confinement"]["abi"] < 6 and probed["confinement"]["reason"]:
        pytest.skip("abstract unix sockets are scoped from Landlock ABI 6 (or left with the network namespace)")
    assert_refused_only_after(probed, "abstract_unix", ("EPERM", "ECONNREFUSED"))


def test_a_granted_device_may_be_opened_for_writing_beside_a_folder_that_may_not(probed):
    assert probed["after.device_written"] == "ok" and probed["confinement"]["devices"] == [probed["given"]["device"]]
    assert_refused_only_after(probed, "write_outside")  # the device's folder is not granted with it


def test_a_thread_started_after_confinement_names_itself_and_cannot_read_its_environment(probed):
    """What the CUDA driver does with each thread it starts (writes its ``comm``) works once the process's own
    ``/proc/PID/task`` is granted for writing; reading beneath it (``environ``: the keys) is still refused."""
    assert probed["before.thread_named"] == probed["after.thread_named"] == "ok"
    assert probed["confinement"]["thread_names"] == [f"/proc/{probed['confined_pid']}/task"]
    assert_refused_only_after(probed, "thread_environ")


def test_a_cuda_runs_device_paths_are_the_nvidia_nodes_and_what_the_driver_reads_and_a_cpu_run_has_none(tmp_path):
    for node in ("dev/nvidiactl", "dev/nvidia0", "dev/nvidia12", "dev/nvidia-uvm", "dev/nvidia-caps/nvidia-cap1",
                 "dev/null", "dev/sda", "proc/driver/nvidia/params", "proc/self/environ",
                 "sys/bus/pci/devices/0000:00:01.0/numa_node", "sys/devices/pci0000:00/x", "sys/devices/virtual/x"):
        (tmp_path / node).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / node).write_text("")
    access = device_access("cuda", tmp_path)
    assert [path.relative_to(tmp_path).as_posix() for path in access.nodes] == [
        "dev/nvidia-caps", "dev/nvidia-uvm", "dev/nvidia0", "dev/nvidia12", "dev/nvidiactl"]
    assert [path.relative_to(tmp_path).as_posix() for path in access.readable] == [
        "proc/driver/nvidia", "sys/bus/pci/devices", "sys/devices/pci0000:00"]
    assert access.thread_names == ()  # this process's /proc/PID/task is not beneath tmp_path
    assert device_access("cuda").thread_names == (Path(f"/proc/{os.getpid()}/task").resolve(),)
    assert device_access("cpu", tmp_path) == DeviceAccess()


def test_a_program_written_into_the_run_folder_cannot_be_executed(probed):
    assert_refused_only_after(probed, "run_written")


def test_a_write_outside_the_writable_folders_is_refused(probed):
    assert_refused_only_after(probed, "write_outside")
    assert not (Path(probed["given"]["outside"]) / "after.txt").exists()


def test_a_read_of_a_data_file_outside_the_allowlist_is_refused(probed):
    assert_refused_only_after(probed, "read_data")


def test_the_folder_opalctl_is_imported_from_is_listed_but_its_files_are_not_readable(probed):
    if not probed["confinement"]["listable"]:
        pytest.skip("opalctl is imported from a readable folder (site-packages): nothing is only listable")
    assert_refused_only_after(probed, "read_beside_package")


def test_torch_and_a_lazily_imported_stdlib_module_still_load(probed):
    assert probed["minidom_loaded_before"] is False
    assert probed["import_minidom"] == "ok"
    assert probed["train_torch"] == "ok"
    assert probed["inherited.torch_loaded_before"] is False  # the grandchild imports torch while confined
    assert probed["inherited.train_torch"] == "ok"


def test_writes_inside_the_run_folder_work(probed):
    assert probed["before.write_inside"] == "ok"
    assert probed["after.write_inside"] == "ok"
    assert (Path(probed["given"]["run"]) / "stage-after" / "state.pt").is_file()


def test_no_device_node_can_be_made_even_in_the_run_folder(probed):
    if probed["before.mknod"] != "ok":
        pytest.skip(f"this user cannot make device nodes anyway ({probed['before.mknod']})")
    assert_refused_only_after(probed, "mknod")


def test_a_process_started_before_confinement_can_be_neither_signalled_nor_read(probed):
    if probed["confinement"]["abi"] < 6:
        pytest.skip("signals are scoped from Landlock ABI 6")
    assert_refused_only_after(probed, "signal_elder", ("EPERM",))
    assert_refused_only_after(probed, "elder_environ")


def test_the_environment_the_process_started_with_is_not_readable(probed):
    assert_refused_only_after(probed, "own_environ")


def test_a_child_process_started_afterwards_inherits_the_confinement(probed):
    assert "inherited.connect" in probed, probed["grandchild_stderr"]
    for probe in ("connect", "bind", "write_outside", "read_data", "own_environ"):
        assert probed[f"inherited.{probe}"] == "EACCES", (probe, probed[f"inherited.{probe}"])
    assert probed["inherited.write_inside"] == "ok"
    assert "Error in cpuinfo" not in probed["grandchild_stderr"]  # torch still reads what it needs on import


def test_training_paths_hold_the_interpreter_and_opalctl_but_not_the_working_folder():
    paths = training_paths()
    assert Path(sys.prefix).resolve() in paths and Path(sys.base_prefix).resolve() in paths
    assert Path(opalctl.__file__).resolve().parent in paths
    assert all(path.exists() for path in paths)
    assert Path.cwd().resolve() not in paths and Path("/proc").resolve() not in paths


def test_confining_from_another_thread_is_refused_before_anything_is_applied():
    errors = []

    def confine() -> None:
        try:
            confine_process(writable=[], readable=[])
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=confine)
    thread.start()
    thread.join()
    assert errors == ["confine_process must run on the main thread: Landlock confines only the calling thread"]
    assert Path(__file__).read_bytes()  # this process stays unconfined: a file outside every allowlist reads


WITHOUT_LANDLOCK = r'''
import ctypes, json, os, sys
from pathlib import Path

# A seccomp filter answers ENOSYS to landlock_create_ruleset (444), as a kernel without Landlock does.
class Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

LOAD_NR, JUMP_IF_EQUAL, RETURN = 0x20, 0x15, 0x06
filter_ = (Instruction * 4)(Instruction(LOAD_NR, 0, 0, 0), Instruction(JUMP_IF_EQUAL, 0, 1, 444),
                            Instruction(RETURN, 0, 0, 0x00050000 | 38), Instruction(RETURN, 0, 0, 0x7FFF0000))
program = Program(4, filter_)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, which a filter needs
assert libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER

from opalctl.sandbox import confine_process, training_paths

outside = Path(sys.argv[1])
if sys.argv[2:] == ["bounded"]:  # the bounds apply without Landlock
    from opalctl.sandbox import Bounds

    confinement = confine_process(writable=[outside / "run"], readable=training_paths(),
                                  bounds=Bounds(file_bytes=1 << 20, no_processes=True, drop_capabilities=True))
    try:
        os.fork()
        forked = "ok"
    except PermissionError:
        forked = "EPERM"
    print(json.dumps({**confinement.to_json(), "fork": forked}))
    sys.exit(0)
confinement = confine_process(writable=[outside / "run"], readable=training_paths())
(outside / "written-after.txt").write_text("nothing was applied")
print(json.dumps(confinement.to_json()))
'''


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="the seccomp filter that hides Landlock is written for x86_64 Linux")
def test_without_landlock_nothing_is_applied_and_the_reason_is_recorded(tmp_path):
    (tmp_path / "run").mkdir()
    child = subprocess.run([sys.executable, "-c", WITHOUT_LANDLOCK, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    confinement = json.loads(child.stdout)
    assert confinement == {"mechanism": "none", "abi": None, "network_denied": False, "writable": [], "readable": [],
                           "listable": [], "bounds": None,
                           "reason": "this kernel has no Landlock (Linux 5.13 or later has it); nothing applied"}
    assert (tmp_path / "written-after.txt").read_text() == "nothing was applied"


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="the seccomp filter that hides Landlock is written for x86_64 Linux")
def test_without_landlock_the_bounds_still_apply_and_are_recorded(tmp_path):
    (tmp_path / "run").mkdir()
    child = subprocess.run([sys.executable, "-c", WITHOUT_LANDLOCK, str(tmp_path), "bounded"], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    confinement = json.loads(child.stdout)
    assert confinement["mechanism"] == "none" and confinement["fork"] == "EPERM"
    bounds = confinement["bounds"]
    assert bounds["processes"] == "none allowed" and bounds["file_bytes"] == 1 << 20
    assert bounds["capabilities"] in ("all dropped", "none held") and bounds["not_applied"] == {}
    assert bounds["memory_bytes"] is None  # not asked
