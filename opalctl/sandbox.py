"""The operating system's confinement of an agent arm's training process: Landlock and bounds, applied in-process.

``FormalRun`` calls ``confine_process`` once, for an agent arm only, after the evaluator, the agent host and the
steps helper are started and the train split is loaded, and before any agent program loads
(docs/architecture.md). From then on the process, and every process it starts afterwards, is held by the kernel
to this:

- **Network.** TCP ``connect`` and ``bind`` are refused (Landlock ABI 4 and later). Where the process may leave
  its network namespace (root with CAP_SYS_ADMIN), it also moves to a new, empty one, so UDP, raw sockets and
  abstract unix sockets reach nothing either; where it may not, ``reason`` says that non-TCP sockets are open.
- **Writing.** Only beneath the ``writable`` folders, plus ``/dev/null``. No device node can be made there (root
  could otherwise make one for the disk and read it past every rule) and nothing there can be executed.
- **Reading.** Only beneath the ``writable`` and ``readable`` paths; ``training_paths()`` lists what a training
  process still needs (the interpreter's prefixes, site-packages, the opalctl package, the system's libraries, a
  few files of ``/etc``, the harmless devices) and none of the protocol's folders. ``/proc`` is not readable
  (only ``/proc/cpuinfo``, which torch reads on import to choose its CPU kernels): ``/proc/self/environ`` keeps
  the environment the process started with (API keys included) however ``os.environ`` is cleaned afterwards.
  The folder the opalctl package is imported from may be listed (its names, not its files), so that a child
  Python can import opalctl from it.
- **A GPU** (``DeviceAccess``, ``device_access``; a run on ``training.device: cuda`` only): the NVIDIA driver's
  device nodes may be opened, written and sent ioctls; what the driver reads about them (``/proc/driver/nvidia``,
  ``/proc/driver/nvidia-uvm``, the PCI devices in ``/sys``) read; and the process's own ``/proc/PID/task`` written,
  not read (the driver names each thread it starts by writing its ``comm``; reading would show the environment):
  the driver does all this again after start-up. Not yet seen working on a GPU.
- **Other processes** (ABI 6 and later): no signal reaches a process outside the confinement, and no abstract
  unix socket of one can be connected to; Landlock also refuses ``ptrace`` and ``/proc/PID/mem``-like access to
  them. Note what this means for the caller: the training process can no longer signal the children it started
  *before* confinement (the evaluator, the agent host, the steps helper); it stops them by closing their pipes,
  and ``kill()`` of one raises ``PermissionError``.

With ``bounds`` (``Bounds``; ``training_bounds`` makes them from a protocol's ``limits``), also:

- **No new process** (a seccomp filter, on x86_64 and aarch64): ``fork``, ``vfork``, ``clone`` without
  ``CLONE_THREAD``, ``execve`` and ``execveat`` fail with EPERM (``PermissionError`` from ``os.fork``,
  ``subprocess``, ``multiprocessing``, ``os.posix_spawn``; ``os.system`` returns a failed status), so no copy of
  the model trains beside the process, off the CPU the evaluator reads from the kernel, and nothing replaces the
  process's image and its guards. No limit can be changed either (``setrlimit``, and ``prlimit64`` when it sets
  one): a thread running before confinement keeps its capabilities. ``clone3`` answers ENOSYS, on which the C library starts a thread with
  ``clone`` instead: threads start as before (torch's intra-op pool, Python threads). The i386 and x32 system
  call ABIs of x86_64 are refused whole. The filter is synchronised to every thread of the process (TSYNC) and
  asks for no speculation mitigation (SPEC_ALLOW), which would slow this arm and not the others. There is no
  process to start after confinement, so the processes a run needs are started before it.
- **Memory** (RLIMIT_DATA): the process's private writable memory (heap, anonymous mappings, thread stacks) stays
  under ``memory_bytes``; past it an allocation fails: ``MemoryError`` in Python and numpy, a ``RuntimeError``
  ("can't allocate memory") in torch, "can't start new thread" for a thread's stack. Address space torch merely
  reserves is not counted, as it would be by RLIMIT_AS. Inside an agent's program that is the program's failure
  (opal/guard.py), elsewhere ``bound_refusal`` gives the sentence the run ends with.
- **One file** (RLIMIT_FSIZE): no file the process writes grows past ``file_bytes``; SIGXFSZ is ignored, so the
  write fails with EFBIG (an ``OSError``) and the process lives on; and a crash writes no core file.
- **No capability**: every capability set is emptied (ambient, bounding, effective, permitted, inheritable), so a
  process run as root can no longer raise its own limits (CAP_SYS_RESOURCE) or act on files it does not own.
  What training still does needs none: it writes files it owns beneath ``training/`` and reads world-readable ones.

Each bound is recorded in ``Confinement.bounds`` (what it became, and in ``not_applied`` why, where the system could
not set it: not Linux, another architecture, a kernel that refused): ``start.json`` and ``report.json`` carry it.

It does **not** stop: anything reached through a file descriptor opened before confinement (pipes to the
evaluator and the host, stdout, open files); reading any file beneath an allowed tree (``/etc/passwd``, every
installed package); named unix sockets beneath allowed trees and, without a new network namespace, UDP; CPU time
(the budget clock charges it); how many threads start (each stack counts toward the memory bound, nothing more);
GPU memory; shared mappings (``mmap.mmap(-1, n)``, ``os.memfd_create``, SysV shared memory: RLIMIT_DATA counts
private memory only, so a program set on passing the bound can; a memfd is a file, each within the one-file
bound) and file-backed mappings (a cgroup's ``memory.max`` would count them all, and needs a delegated cgroup;
the CUDA driver needs ``memfd_create``, so no filter refuses it); kernel memory (pipe and socket buffers); the
total size of ``training/`` (each file within its bound, the sum checked by the evaluator at every
stage: opalctl/training_folder.py); Python threads that were already running (``reason`` names them; the seccomp
filter reaches them, Landlock and the dropped capabilities do not); and a kernel without Landlock or seccomp
(Linux before 5.13, Landlock disabled at boot, macOS): there ``confine_process`` applies what exists and says why
for the rest, never raising.

Landlock confines the calling thread and the threads and processes it starts afterwards, not threads that already
run: ``confine_process`` must be called from the main thread, before any thread that runs agent code starts (it
raises ``RuntimeError`` off the main thread, a bug in the caller). ``PR_SET_NO_NEW_PRIVS`` is set first, as
Landlock and seccomp require; a later ``execve`` would keep the confinement. The system calls are made through
``ctypes`` (``include/uapi/linux/landlock.h``, ``seccomp.h``, ``filter.h``, ``audit.h``, ``capability.h``,
``prctl.h`` and ``sched.h`` define the numbers and structures; the system call numbers are the architecture's
table); the ruleset handles every access right the running ABI knows, up to ABI 7 (which adds only logging
flags, left at their defaults).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import site
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import opalctl
from opalctl.errors import OpalctlError
from opalctl.files import size_text
from opalctl.training_folder import training_folder_bytes

SYSCALL_CREATE_RULESET, SYSCALL_ADD_RULE, SYSCALL_RESTRICT_SELF = 444, 445, 446  # the same on every architecture
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNET = 0x40000000
NEWEST_KNOWN_ABI = 7

# Each access right: its bit and the first ABI that knows it. A ruleset handles every right its ABI knows, so a
# right no rule grants is refused everywhere.
FS_RIGHTS = {
    "execute": (1 << 0, 1), "write_file": (1 << 1, 1), "read_file": (1 << 2, 1), "read_dir": (1 << 3, 1),
    "remove_dir": (1 << 4, 1), "remove_file": (1 << 5, 1), "make_char": (1 << 6, 1), "make_dir": (1 << 7, 1),
    "make_reg": (1 << 8, 1), "make_sock": (1 << 9, 1), "make_fifo": (1 << 10, 1), "make_block": (1 << 11, 1),
    "make_sym": (1 << 12, 1), "refer": (1 << 13, 2), "truncate": (1 << 14, 3), "ioctl_dev": (1 << 15, 5),
}
NET_RIGHTS = {"bind_tcp": (1 << 0, 4), "connect_tcp": (1 << 1, 4)}
SCOPES = {"abstract_unix_socket": (1 << 0, 6), "signal": (1 << 1, 6)}
FILE_RIGHTS = frozenset({"execute", "write_file", "read_file", "truncate", "ioctl_dev"})  # what a rule on a file may hold

READ = ("read_file", "read_dir", "execute")
WRITE = ("read_file", "read_dir", "write_file", "truncate", "make_reg", "make_dir", "make_sym", "make_sock",
         "make_fifo", "remove_file", "remove_dir", "refer")  # never make_char, make_block, execute, ioctl_dev
LIST = ("read_dir",)
ALWAYS_WRITABLE = ("/dev/null",)  # subprocess.DEVNULL opens it for writing

# The NVIDIA driver's device nodes, which a CUDA process opens again after start-up (a new channel, the memory
# manager), and what it reads about them; granted (read, write, ioctl) only to a run whose training.device is cuda
CUDA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
                     "/dev/nvidia-caps", "/dev/nvidia[0-9]*")
CUDA_READABLE = ("/proc/driver/nvidia", "/proc/driver/nvidia-uvm", "/sys/bus/pci/devices", "/sys/devices/pci*",
                 "/sys/module/nvidia")
DEVICE = ("read_file", "read_dir", "write_file", "ioctl_dev")
THREAD_NAMES = ("write_file", "truncate")  # fopen(comm, "w") opens with O_TRUNC

SYSTEM_FOLDERS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/sys/devices/system/cpu", "/sys/fs/cgroup")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/nsswitch.conf",
                "/etc/passwd", "/etc/group", "/etc/os-release", "/proc/cpuinfo", "/dev/zero", "/dev/urandom", "/dev/random")


@dataclass(frozen=True)
class Confinement:
    """What ``confine_process`` applied: recorded in ``start.json`` and ``report.json`` as ``to_json()``."""

    mechanism: str  # "landlock" or "none"
    abi: int | None  # the kernel's Landlock ABI; None where there is none
    network_denied: bool  # TCP connect and bind refused (and, with a new network namespace, every socket)
    writable: tuple[str, ...]
    readable: tuple[str, ...]
    reason: str | None  # why nothing, or less than asked, was applied
    listable: tuple[str, ...] = ()  # folders whose names (not files) may be read
    bounds: dict | None = None  # what _apply_bounds set (the module docstring); None where none was asked
    devices: tuple[str, ...] = ()  # device nodes that may be opened, written and sent ioctls (a GPU's)
    thread_names: tuple[str, ...] = ()  # the process's /proc/PID/task, written and never read (a GPU's driver)

    def to_json(self) -> dict:
        """The record; ``devices`` and ``thread_names`` only where granted (a CPU run's record is as it was)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()
                if key not in ("devices", "thread_names") or value}


@dataclass(frozen=True)
class DeviceAccess:
    """What a training process on a GPU still opens after confinement, beyond what every training process does
    (the module docstring's "A GPU"); none on the CPU."""

    nodes: tuple[Path, ...] = ()  # opened for reading and writing, sent ioctls
    readable: tuple[Path, ...] = ()  # what the driver reads about them
    thread_names: tuple[Path, ...] = ()  # the process's own /proc/PID/task: written, never read


def training_paths() -> list[Path]:
    """What a training process must still read after confinement, and nothing of a protocol's folders."""
    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *site.getsitepackages(),
                  site.getusersitepackages(), Path(opalctl.__file__).parent, *SYSTEM_FOLDERS, *SYSTEM_FILES]
    return _existing(candidates)


def device_access(device: str, root: Path = Path("/")) -> DeviceAccess:
    """What a training process on ``device`` opens after confinement (``DeviceAccess``), of what exists beneath
    ``root``: ``CUDA_DEVICE_NODES``, ``CUDA_READABLE`` and this process's ``/proc/PID/task``; nothing on the CPU."""
    if device != "cuda":
        return DeviceAccess()

    def found(patterns) -> tuple[Path, ...]:
        return tuple(_existing(sorted(path for pattern in patterns for path in root.glob(pattern.lstrip("/")))))

    # by number, not /proc/self: Landlock holds the inode, and this process's is the one to name
    return DeviceAccess(found(CUDA_DEVICE_NODES), found(CUDA_READABLE), found([f"/proc/{os.getpid()}/task"]))


def confine_process(*, writable: list[Path], readable: list[Path], deny_network: bool = True,
                    bounds: Bounds | None = None, devices: DeviceAccess = DeviceAccess()) -> Confinement:
    """Confine this process and its future children (see the module docstring), and set ``bounds`` where given;
    ``devices`` (``device_access``) as the module docstring's "A GPU" says. Never raises for a
    missing Landlock or a bound the system cannot set (the record says why). Call from the main thread, before any
    thread that runs agent code starts."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("confine_process must run on the main thread: Landlock confines only the calling thread")
    writable_paths = _existing(writable)
    readable_paths = [path for path in _existing([*readable, *devices.readable]) if path not in writable_paths]
    listable = [path for path in _import_roots() if not _beneath_any(path, writable_paths + readable_paths)]
    notes = _notes(writable, writable_paths)
    data_bytes = _data_bytes() if bounds is not None else None  # /proc is unreadable once Landlock applies
    confinement = _landlock(writable_paths, readable_paths, listable, deny_network, notes, devices)
    if bounds is not None:
        confinement = replace(confinement, bounds=_apply_bounds(bounds, data_bytes))
    return confinement


def _landlock(writable_paths: list[Path], readable_paths: list[Path], listable: list[Path], deny_network: bool,
              notes: list[str], devices: DeviceAccess) -> Confinement:
    abi, missing = _landlock_abi()
    if abi is None:
        return Confinement("none", None, False, (), (), missing)
    try:
        ruleset = _Ruleset(abi, deny_network)
        try:
            for path in [*writable_paths, *map(Path, ALWAYS_WRITABLE)]:
                ruleset.allow(path, WRITE)
            for path in readable_paths:
                ruleset.allow(path, READ)
            for path in listable:
                ruleset.allow(path, LIST)
            for path in devices.nodes:
                ruleset.allow(path, DEVICE)
            for path in devices.thread_names:
                ruleset.allow(path, THREAD_NAMES)
            network_denied, network_note = _leave_network(abi) if deny_network else (False, None)
            ruleset.restrict()
        finally:
            ruleset.close()
    except OSError as error:
        return Confinement("none", abi, False, (), (), f"Landlock refused the ruleset ({error}); nothing applied")
    notes += [network_note] if network_note else []
    return Confinement("landlock", abi, network_denied, _shown(writable_paths), _shown(readable_paths),
                       "; ".join(notes) or None, _shown(listable), devices=_shown(devices.nodes),
                       thread_names=_shown(devices.thread_names))


# --------------------------------------------------------------------------------------------------------------
# the paths


def _existing(paths) -> list[Path]:
    """Each path that exists, resolved (Landlock holds the inode a path names, not its text), once, in order."""
    out: list[Path] = []
    for path in paths:
        if not path:
            continue
        resolved = Path(path).resolve()
        if resolved.exists() and resolved not in out:
            out.append(resolved)
    return out


def _import_roots() -> list[Path]:
    """The folder opalctl is imported from: a child Python must list it to find the package there again."""
    return _existing([Path(opalctl.__file__).resolve().parent.parent])


def _beneath_any(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _shown(paths: list[Path]) -> tuple[str, ...]:
    return tuple(str(path) for path in paths)


def _notes(asked: list[Path], kept: list[Path]) -> list[str]:
    """What the record says was not applied: writable paths that do not exist, threads that stay unconfined."""
    notes = []
    gone = [str(path) for path in asked if Path(path).resolve() not in kept]
    if gone:
        notes.append(f"writable paths that do not exist were left out: {', '.join(gone)}")
    others = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    if others:
        notes.append(f"Python threads already running stay unconfined: {', '.join(others)}")
    return notes


# --------------------------------------------------------------------------------------------------------------
# the system calls


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's structure is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall(number: int, *args) -> int:
    result = _libc().syscall(ctypes.c_long(number), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def _landlock_abi() -> tuple[int | None, str | None]:
    """The kernel's Landlock ABI, or None and why there is none."""
    if sys.platform != "linux":
        return None, f"Landlock is a Linux facility and this system is {sys.platform}; nothing applied"
    try:
        abi = _syscall(SYSCALL_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    except (AttributeError, TypeError) as error:  # a libc without syscall(): nothing to call through
        return None, f"Landlock cannot be called here ({error}); nothing applied"
    except OSError as error:
        why = {errno.ENOSYS: "this kernel has no Landlock (Linux 5.13 or later has it)",
               errno.EOPNOTSUPP: "Landlock is disabled on this kernel (see the lsm= boot parameter)"}
        return None, f"{why.get(error.errno, f'Landlock is unavailable ({error})')}; nothing applied"
    return int(abi), None


def _bits(table: dict[str, tuple[int, int]], names, abi: int) -> int:
    """The mask of ``names`` that this ABI knows (a right it does not know is neither handled nor granted)."""
    mask = 0
    for name in names:
        bit, since = table[name]
        if since <= abi:
            mask |= bit
    return mask


class _Ruleset:
    """One Landlock ruleset: created handling every right its ABI knows, given rules, then applied to this thread."""

    def __init__(self, abi: int, deny_network: bool):
        self.abi = abi
        known = min(abi, NEWEST_KNOWN_ABI)
        attr = _RulesetAttr(handled_access_fs=_bits(FS_RIGHTS, FS_RIGHTS, known),
                            handled_access_net=_bits(NET_RIGHTS, NET_RIGHTS, known) if deny_network else 0,
                            scoped=_bits(SCOPES, SCOPES, known) if deny_network else _bits(SCOPES, ["signal"], known))
        size = 8 if known < 4 else (16 if known < 6 else 24)  # the structure as this ABI defines it
        self.fd = _syscall(SYSCALL_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))

    def allow(self, path: Path, names) -> None:
        """Grant ``names`` beneath ``path`` (a file takes only the rights that apply to a file)."""
        known = min(self.abi, NEWEST_KNOWN_ABI)
        opened = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not Path(path).is_dir():
                names = [name for name in names if name in FILE_RIGHTS]
            attr = _PathBeneathAttr(allowed_access=_bits(FS_RIGHTS, names, known), parent_fd=opened)
            if attr.allowed_access:
                _syscall(SYSCALL_ADD_RULE, ctypes.c_int(self.fd), ctypes.c_int(RULE_PATH_BENEATH),
                         ctypes.byref(attr), ctypes.c_uint32(0))
        finally:
            os.close(opened)

    def restrict(self) -> None:
        if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")
        _syscall(SYSCALL_RESTRICT_SELF, ctypes.c_int(self.fd), ctypes.c_uint32(0))

    def close(self) -> None:
        os.close(self.fd)


def _leave_network(abi: int) -> tuple[bool, str | None]:
    """A new, empty network namespace where this process may make one; TCP is refused by Landlock either way."""
    tcp = abi >= 4
    if _libc().unshare(CLONE_NEWNET) == 0:
        return True, None
    code = ctypes.get_errno()
    if tcp:
        return True, f"UDP and other non-TCP sockets still reach the network (no new network namespace: " \
                     f"{os.strerror(code)})"
    return False, f"the network is open: Landlock ABI {abi} cannot refuse TCP (4 can) and no new network " \
                  f"namespace could be made ({os.strerror(code)})"


# --------------------------------------------------------------------------------------------------------------
# the bounds: memory, files, processes, capabilities

MEMORY_AUTO = "auto"
MEMORY_SHARE = 3, 4  # auto: three quarters of the memory the machine gives the process; the rest is left to the
# evaluator, the agent host, the steps helper and the system
FILE_FLOOR_BYTES = 1 << 30  # one file's bound is never below this: the run's log (a grid's grid.log is the run's
# stdout) and the agent optimizer's records grow with the run, beside checkpoints within limits.checkpoint_bytes


@dataclass(frozen=True)
class Bounds:
    """What ``confine_process`` bounds beside Landlock, each where the system allows it (None or False: not asked).

    ``memory_bytes`` caps the process's private writable memory (RLIMIT_DATA); ``file_bytes`` any one file it
    writes (RLIMIT_FSIZE, SIGXFSZ ignored so a write past it fails with EFBIG; and no core file);
    ``no_processes`` refuses every new process and every ``execve`` (a seccomp filter; threads still start);
    ``drop_capabilities`` empties every capability set, so a root process can no longer raise its own limits. The
    rules and ``folder_bytes`` are recorded only: how the numbers were chosen, and the bound on the training
    folder that the evaluator checks from outside (opalctl/training_folder.py)."""

    memory_bytes: int | None = None
    file_bytes: int | None = None
    no_processes: bool = False
    drop_capabilities: bool = False
    memory_rule: str | None = None
    file_rule: str | None = None
    folder_bytes: int | None = None
    folder_rule: str | None = None


def training_bounds(limits, stages: int, ranks: int = 1) -> Bounds:
    """Every bound of an agent arm's training process, from the protocol's ``limits`` (``schema.Limits``), its
    number of stages (``budget.fractions``) and the number of ranks sharing this machine. Call it before
    ``confine_process``: resolving ``memory_bytes: auto`` reads ``/proc/self/cgroup``."""
    memory, memory_rule = memory_bound(limits.memory_bytes, ranks)
    folder, folder_rule = training_folder_bytes(limits, stages)
    return Bounds(memory_bytes=memory, file_bytes=max(int(limits.checkpoint_bytes), FILE_FLOOR_BYTES),
                  no_processes=True, drop_capabilities=True, memory_rule=memory_rule,
                  file_rule="the larger of limits.checkpoint_bytes and 1 GiB", folder_bytes=folder,
                  folder_rule=folder_rule)


def memory_bound(value: int | str, ranks: int = 1) -> tuple[int, str]:
    """``limits.memory_bytes`` in bytes, and the rule that gave it: the number itself, or for ``auto`` three
    quarters of the memory the machine gives this process, shared by its ranks."""
    if value != MEMORY_AUTO:
        return int(value), "limits.memory_bytes"
    machine, source = machine_memory()
    share = machine * MEMORY_SHARE[0] // MEMORY_SHARE[1] // max(1, int(ranks))
    shared = f", shared by {ranks} ranks" if ranks > 1 else ""
    return share, f"limits.memory_bytes auto: three quarters of {source} ({size_text(machine)}){shared}"


def machine_memory() -> tuple[int, str]:
    """The memory this process may use, and where that figure comes from: the machine's physical memory, or its
    cgroup's limit where that is lower (a container, a Slurm job)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _cgroup_memory()
    if cgroup is not None and cgroup[0] < physical:
        return cgroup[0], f"the memory its cgroup allows ({cgroup[1]})"
    return physical, "this machine's memory"


def _cgroup_memory() -> tuple[int, str] | None:
    """The lowest memory limit on the way from this process's cgroup up to the hierarchy's root, and its file."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    lowest: tuple[int, str] | None = None
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":  # cgroup v2 (Documentation/admin-guide/cgroup-v2.rst)
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1's memory controller
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        folder = base / where.strip("/")
        while folder == base or folder.is_relative_to(base):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                text = "max"
            if text.isdigit() and (lowest is None or int(text) < lowest[0]):
                lowest = int(text), str(folder / name)
            if folder == base:
                break
            folder = folder.parent
    return lowest


_applied: dict | None = None  # this process's bounds record, once confine_process set any (bound_refusal reads it)


def _apply_bounds(bounds: Bounds, data_bytes: int | None) -> dict:
    """Set each bound asked, in the order that needs it (the limits while the capabilities that could raise them
    are held, then the capabilities, then the filter); the record of what each became and why, where it could
    not be set."""
    global _applied
    record = {"memory_bytes": None, "memory_rule": bounds.memory_rule, "data_bytes_at_confinement": data_bytes,
              "file_bytes": None, "file_rule": bounds.file_rule, "processes": None, "limits_fixed": False,
              "capabilities": None,
              "training_folder_bytes": bounds.folder_bytes, "training_folder_rule": bounds.folder_rule,
              "not_applied": {}}
    not_applied = record["not_applied"]
    if bounds.memory_bytes is not None:
        record["memory_bytes"], why = _set_limit("RLIMIT_DATA", bounds.memory_bytes)
        why = why or _data_limit_ignored()
        if why:
            not_applied["memory_bytes"] = why
    if bounds.file_bytes is not None:
        record["file_bytes"], why = _set_limit("RLIMIT_FSIZE", bounds.file_bytes)
        if why:
            not_applied["file_bytes"] = why
        else:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the bound fails with EFBIG instead
            _set_limit("RLIMIT_CORE", 0)  # a crash the program provokes writes no core file, wherever the cwd is
    if bounds.drop_capabilities:
        record["capabilities"], why = _drop_capabilities()
        if why:
            not_applied["capabilities"] = why
    if bounds.no_processes:
        record["processes"], why = _deny_processes()
        record["limits_fixed"] = record["processes"] is not None  # the same filter refuses setrlimit
        if why:
            not_applied["processes"] = why
    _applied = record
    return record


def _set_limit(name: str, value: int) -> tuple[int | None, str | None]:
    """Soft and hard limit ``name`` at ``value`` (never above a hard limit already lower); what it became, or why
    it could not be set."""
    try:
        import resource
    except ImportError:
        return None, f"{sys.platform} has no resource limits; not bounded"
    number = getattr(resource, name, None)
    if number is None:
        return None, f"this system has no {name}; not bounded"
    _, hard = resource.getrlimit(number)
    value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
    try:
        resource.setrlimit(number, (value, value))
    except (ValueError, OSError) as error:
        return None, f"setrlimit({name}) was refused ({error}); not bounded"
    return value, None


def _data_limit_ignored() -> str | None:
    """Why RLIMIT_DATA holds no mapping on this kernel, if it does not: booted with ignore_rlimit_data (mm/mmap.c),
    it only warns."""
    try:
        ignored = Path("/sys/module/kernel/parameters/ignore_rlimit_data").read_text().strip() == "Y"
    except OSError:
        return None
    return "this kernel was booted with ignore_rlimit_data: RLIMIT_DATA is set but bounds only brk" if ignored \
        else None


def _data_bytes() -> int | None:
    """This process's private writable memory now (VmData, what RLIMIT_DATA counts), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def bound_refusal(error: BaseException, continue_with: str) -> OpalctlError | None:
    """The one sentence a run ends with when ``error`` is this process reaching a bound ``confine_process`` set,
    outside the agent's programs (a guarded program call turns its own into a program failure): its memory
    (a MemoryError, torch's "can't allocate memory", ENOMEM, a thread that cannot start) or one file's size
    (EFBIG). ``continue_with`` is what continues the run ("resume with: opalctl run ... --resume"). None for
    anything else, and in a process without bounds."""
    applied = _applied
    if applied is None:
        return None
    if applied.get("memory_bytes") is not None and (cause := _memory_cause(error)) is not None:
        rule = applied.get("memory_rule") or "limits.memory_bytes"
        return OpalctlError(f"the training process reached its memory bound of {size_text(applied['memory_bytes'])} "
                            f"({rule}) outside the agent's programs ({cause}); {continue_with}, on a machine with "
                            f"more memory if limits.memory_bytes is auto, or freeze the protocol again with a "
                            f"larger limits.memory_bytes")
    if applied.get("file_bytes") is not None and (cause := _file_cause(error)) is not None:
        return OpalctlError(f"a file the training process wrote reached its bound on one file of "
                            f"{size_text(applied['file_bytes'])} ({applied.get('file_rule')}): {cause}; {continue_with}, "
                            f"or freeze the protocol again with a larger limits.checkpoint_bytes")
    return None


def _causes(error: BaseException):
    seen: list[BaseException] = []
    while error is not None and error not in seen and len(seen) < 8:
        seen.append(error)
        yield error
        error = error.__cause__ or error.__context__


def _memory_cause(error: BaseException) -> str | None:
    for cause in _causes(error):
        if isinstance(cause, MemoryError):
            return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        if isinstance(cause, OSError) and cause.errno == errno.ENOMEM:
            return f"{cause.strerror or cause}"
        if isinstance(cause, RuntimeError) and any(text in str(cause) for text in (
                "can't allocate memory", "not enough memory", "can't start new thread")):
            return str(cause).split("DefaultCPUAllocator: ")[-1][:200]
    return None


def _file_cause(error: BaseException) -> str | None:
    for cause in _causes(error):
        if isinstance(cause, OSError) and cause.errno == errno.EFBIG:
            return f"{cause.filename}: {cause.strerror}" if cause.filename else f"{cause.strerror or cause}"
    return None


# capabilities: include/uapi/linux/capability.h and include/uapi/linux/prctl.h

CAPABILITY_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
PR_CAPBSET_READ, PR_CAPBSET_DROP = 23, 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _prctl(option: int, *args: int) -> int:
    """prctl with every argument as the unsigned long the kernel reads; -1 with errno set on failure."""
    values = [ctypes.c_ulong(value) for value in (*args, 0, 0, 0, 0)[:4]]
    return _libc().prctl(ctypes.c_int(option), *values)


def _capability_sets() -> tuple[int, int, int]:
    """This thread's effective, permitted and inheritable sets, as 64-bit masks."""
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc().capget(ctypes.byref(header), data) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"capget: {os.strerror(code)}")
    return tuple(getattr(data[0], name) | getattr(data[1], name) << 32
                 for name in ("effective", "permitted", "inheritable"))


def _bounding_set() -> list[int]:
    """The capabilities still in this thread's bounding set (PR_CAPBSET_READ answers EINVAL past the last one
    the kernel knows)."""
    held = []
    for number in range(64):
        answer = _prctl(PR_CAPBSET_READ, number)
        if answer < 0:
            break
        if answer:
            held.append(number)
    return held


def _drop_capabilities() -> tuple[str | None, str | None]:
    """Empty the ambient, bounding, effective, permitted and inheritable sets: after it, not even root can raise
    its own limits (CAP_SYS_RESOURCE) or undo the rest. What the training process still does needs none: it
    writes files it owns beneath its folder and reads world-readable ones."""
    if sys.platform != "linux":
        return None, f"capabilities are a Linux facility and this system is {sys.platform}; nothing dropped"
    try:
        held = _capability_sets()
    except (AttributeError, OSError) as error:
        return None, f"the capabilities cannot be read here ({error}); nothing dropped"
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)  # EINVAL before Linux 4.3, which has no ambient set
    for number in _bounding_set():
        _prctl(PR_CAPBSET_DROP, number)  # EPERM without CAP_SETPCAP: no_new_privs keeps exec from using it
    header, empty = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc().capset(ctypes.byref(header), empty) != 0:
        code = ctypes.get_errno()
        return None, f"capset refused to empty the capability sets ({os.strerror(code)}); nothing dropped"
    if any(_capability_sets()):
        return None, "the capability sets are not empty after capset; some may remain"
    return ("all dropped" if any(held) else "none held"), None


# processes: a seccomp filter (include/uapi/linux/seccomp.h, include/uapi/linux/filter.h)

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1 << 0  # every thread of the process takes the filter, not only the caller
SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1 << 2  # no forced speculation mitigation: it would slow this arm alone
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH, SECCOMP_DATA_ARG0 = 0, 4, 16  # struct seccomp_data; arg 0's low word (LE)
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
CLONE_THREAD = 0x00010000  # include/uapi/linux/sched.h


@dataclass(frozen=True)
class Syscalls:
    """One architecture's numbers: its AUDIT_ARCH (include/uapi/linux/audit.h) and the calls the filter names."""

    arch: int
    seccomp: int
    clone: int
    clone3: int
    refused: tuple[int, ...]  # fork, vfork (where they exist), execve, execveat, setrlimit
    prlimit64: int  # refused when it sets a limit, allowed when it only reads one (getrlimit's way in the C library)
    foreign_from: int | None = None  # numbers from here on belong to another ABI of the same arch (x32)


SYSCALLS = {  # arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h for aarch64
    "x86_64": Syscalls(0xC000003E, seccomp=317, clone=56, clone3=435, refused=(57, 58, 59, 322, 160),
                       prlimit64=302, foreign_from=0x40000000),  # __X32_SYSCALL_BIT
    "aarch64": Syscalls(0xC00000B7, seccomp=277, clone=220, clone3=435, refused=(221, 281, 164), prlimit64=261),
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def process_filter(calls: Syscalls) -> list[tuple[int, int, int, int]]:
    """The classic BPF program, as (code, jt, jf, k): another architecture's calls (the i386 ABI on x86_64) and
    x32's are refused whole; clone3 answers ENOSYS, so the C library falls back to clone for a thread; clone
    passes only with CLONE_THREAD (a thread of this process: the kernel requires CLONE_VM with it); fork,
    vfork, execve, execveat and setrlimit answer EPERM, and so does prlimit64 when it sets a limit (its third
    argument, the new limit, is not NULL): a thread that was running before confinement keeps its capabilities
    (they are a thread's, and the filter reaches every thread), so the limits are fixed here too; everything
    else passes."""
    deny, no_clone3 = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    program: list = [("load", SECCOMP_DATA_ARCH), (BPF_JEQ_K, calls.arch, None, "deny"), ("load", SECCOMP_DATA_NR)]
    if calls.foreign_from is not None:
        program.append((BPF_JGE_K, calls.foreign_from, "deny", None))
    program += [(BPF_JEQ_K, calls.clone3, "no_clone3", None), (BPF_JEQ_K, calls.clone, "clone", None),
                (BPF_JEQ_K, calls.prlimit64, "prlimit64", None)]
    program += [(BPF_JEQ_K, number, "deny", None) for number in calls.refused]
    program += [("return", SECCOMP_RET_ALLOW), "clone", ("load", SECCOMP_DATA_ARG0),
                (BPF_JSET_K, CLONE_THREAD, "allow", "deny"),
                "prlimit64", ("load", SECCOMP_DATA_ARG0 + 16), (BPF_JEQ_K, 0, None, "deny"),  # arg 2, low word
                ("load", SECCOMP_DATA_ARG0 + 20), (BPF_JEQ_K, 0, "allow", "deny"),  # and its high word
                "allow", ("return", SECCOMP_RET_ALLOW), "deny", ("return", deny), "no_clone3", ("return", no_clone3)]
    return _assemble(program)


def _assemble(program: list) -> list[tuple[int, int, int, int]]:
    """Labels (strings) to the 8-bit forward offsets of classic BPF (None: the next instruction)."""
    places, index = {}, 0
    for item in program:
        if isinstance(item, str):
            places[item] = index
        else:
            index += 1
    out = []
    for item in program:
        if isinstance(item, str):
            continue
        if item[0] == "load":
            out.append((BPF_LD_W_ABS, 0, 0, item[1]))
        elif item[0] == "return":
            out.append((BPF_RET_K, 0, 0, item[1]))
        else:
            code, k, true, false = item
            here = len(out) + 1
            out.append((code, 0 if true is None else places[true] - here, 0 if false is None else places[false] - here,
                        k))
    return out


def _deny_processes() -> tuple[str | None, str | None]:
    """Install ``process_filter`` on every thread; what it allows, or why it could not be installed."""
    machine = os.uname().machine if hasattr(os, "uname") else sys.platform
    calls = SYSCALLS.get(machine)
    if sys.platform != "linux":
        return None, f"seccomp is a Linux facility and this system is {sys.platform}; new processes stay possible"
    if calls is None or ctypes.sizeof(ctypes.c_void_p) != 8 or sys.byteorder != "little":
        return None, (f"no seccomp filter is written for this architecture ({machine}, a "
                      f"{8 * ctypes.sizeof(ctypes.c_void_p)}-bit Python); new processes stay possible")
    instructions = process_filter(calls)
    program = _SockFprog(len(instructions), (_SockFilter * len(instructions))(*instructions))
    if _prctl(PR_SET_NO_NEW_PRIVS, 1) != 0:  # a filter needs it (Landlock set it already, where it applied)
        return None, f"prctl(PR_SET_NO_NEW_PRIVS) was refused ({os.strerror(ctypes.get_errno())}); no filter"
    flags, note = SECCOMP_FILTER_FLAG_TSYNC | SECCOMP_FILTER_FLAG_SPEC_ALLOW, ""
    try:
        try:
            answer = _syscall(calls.seccomp, ctypes.c_uint(SECCOMP_SET_MODE_FILTER), ctypes.c_uint(flags),
                              ctypes.byref(program))
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            note = " (a kernel before Linux 4.17: it turns speculation mitigations on for a filtered process)"
            answer = _syscall(calls.seccomp, ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                              ctypes.c_uint(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(program))
    except OSError as error:
        return None, f"the seccomp filter was refused ({error}); new processes stay possible"
    if answer != 0:  # TSYNC names a thread that could not take it
        return None, f"thread {answer} could not take the seccomp filter; new processes stay possible"
    return f"none allowed{note}", None  # and no limit changed: the filter refuses setrlimit too
