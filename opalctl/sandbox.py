"""The operating system's confinement of an agent arm's training process: Landlock, applied in-process.

``FormalRun`` calls ``confine_process`` once, for an agent arm only, after the evaluator and the agent host are
started and the train split is loaded, and before any agent program loads (docs/architecture.md). From then on
the process, and every process it starts afterwards, is held by the kernel to this:

- **Network.** TCP ``connect`` and ``bind`` are refused (Landlock ABI 4 and later). Where the process may leave
  its network namespace (root with CAP_SYS_ADMIN), it also moves to a new, empty one, so UDP, raw sockets and
  abstract unix sockets reach nothing either; where it may not, ``reason`` says that non-TCP sockets are open.
- **Writing.** Only beneath the ``writable`` folders, plus ``/dev/null``. No device node can be made there (root
  could otherwise make one for the disk and read it past every rule) and nothing there can be executed.
- **Reading.** Only beneath the ``writable`` and ``readable`` paths; ``training_paths()`` lists what a training
  process still needs (the interpreter's prefixes, site-packages, the opalctl package, the system's libraries, a
  few files of ``/etc``, the harmless devices) and none of the protocol's folders. ``/proc`` is not readable
  (only ``/proc/cpuinfo``, which torch reads on import to choose its CPU kernels): ``/proc/self/environ`` keeps
  the environment the process started with (API keys included) however ``os.environ`` is cleaned afterwards. The folder the opalctl package is imported from may be listed (its names,
  not its files), so that a child Python (the steps helper) can import opalctl from it.
- **Other processes** (ABI 6 and later): no signal reaches a process outside the confinement, and no abstract
  unix socket of one can be connected to; Landlock also refuses ``ptrace`` and ``/proc/PID/mem``-like access to
  them. Note what this means for the caller: the training process can no longer signal the children it started
  *before* confinement (the evaluator, the agent host); it stops them by closing their pipes, and ``kill()`` of
  one raises ``PermissionError``.

It does **not** stop: anything reached through a file descriptor opened before confinement (pipes to the
evaluator and the host, stdout, open files); reading any file beneath an allowed tree (``/etc/passwd``, every
installed package); named unix sockets beneath allowed trees and, without a new network namespace, UDP; use of
CPU, memory and disk space (the limits of each run are elsewhere); Python threads that were already running
(``reason`` names them); and a kernel without Landlock (Linux before 5.13, Landlock disabled at boot, macOS):
there ``confine_process`` applies nothing and returns mechanism ``"none"`` with the reason, never raising.

Landlock confines the calling thread and the threads and processes it starts afterwards, not threads that already
run: ``confine_process`` must be called from the main thread, before any thread that runs agent code starts (it
raises ``RuntimeError`` off the main thread, a bug in the caller). ``PR_SET_NO_NEW_PRIVS`` is set first, as
Landlock requires; a later ``execve`` keeps the confinement. The system calls are made through ``ctypes``
(``include/uapi/linux/landlock.h`` defines the numbers and structures); the ruleset handles every access right
the running ABI knows, up to ABI 7 (which adds only logging flags, left at their defaults).
"""

from __future__ import annotations

import ctypes
import errno
import os
import site
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

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

    def to_json(self) -> dict:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def training_paths() -> list[Path]:
    """What a training process must still read after confinement, and nothing of a protocol's folders."""
    import opalctl

    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *site.getsitepackages(),
                  site.getusersitepackages(), Path(opalctl.__file__).parent, *SYSTEM_FOLDERS, *SYSTEM_FILES]
    return _existing(candidates)


def confine_process(*, writable: list[Path], readable: list[Path], deny_network: bool = True) -> Confinement:
    """Confine this process and its future children (see the module docstring); never raises for a missing
    Landlock. Call from the main thread, before any thread that runs agent code starts."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("confine_process must run on the main thread: Landlock confines only the calling thread")
    writable_paths = _existing(writable)
    readable_paths = [path for path in _existing(readable) if path not in writable_paths]
    listable = [path for path in _import_roots() if not _beneath_any(path, writable_paths + readable_paths)]
    notes = _notes(writable, writable_paths)
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
            network_denied, network_note = _leave_network(abi) if deny_network else (False, None)
            ruleset.restrict()
        finally:
            ruleset.close()
    except OSError as error:
        return Confinement("none", abi, False, (), (), f"Landlock refused the ruleset ({error}); nothing applied")
    notes += [network_note] if network_note else []
    return Confinement("landlock", abi, network_denied, _shown(writable_paths), _shown(readable_paths),
                       "; ".join(notes) or None, _shown(listable))


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
    import opalctl

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
