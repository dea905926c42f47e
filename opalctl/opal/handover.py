"""The secret-looking variables of the environment, and how an ``opalctl run`` process hands them to its agent host
without ever holding them itself.

A process keeps the environment it was started with for as long as it lives: the block the kernel copied onto its
stack at ``exec`` stays there when a variable is removed from ``os.environ``, readable by any code of the process
(through libc's ``environ``, ``ctypes.string_at``, or ``/proc/self/environ`` where the OS allows). Code with
arbitrary execution in the training process would find a key there. So ``opalctl run`` (a process opalctl owns:
``cli.main()`` with no arguments) re-executes itself at once, before anything heavy is imported
(``reexec_without_secrets``): the same pid, arguments and standard streams, without the secret-looking variables
(``secret_names``). Their values wait in a pipe whose read end the new image inherits, named by ``OPALCTL_HANDOVER``
(``"PID FD NAME..."``: the process it is meant for, the pipe's descriptor, the names handed over; the names are no
secret, and a backend checks by them that its key will be there). The training process never reads the pipe: the
agent host, started with the descriptor (``pass_fds``), reads the values into its own environment (``take``), and
``release`` closes this process's end unread before the training process is confined.

A process that is not the one the variable was made for (a child: another pid) sees no handover.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import sys
from dataclasses import dataclass

# the names of environment variables that hold secrets (API keys, tokens, passwords)
SECRET_NAME = re.compile(r"(?i)(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)($|_)|SECRET")
HANDOVER = "OPALCTL_HANDOVER"  # not secret-looking itself: it names a descriptor and names, never a value
F_SETPIPE_SZ = 1031  # Linux's fcntl to grow a pipe's buffer (fcntl.F_SETPIPE_SZ from Python 3.10 on some builds)


def secret_names(environ) -> list[str]:
    """The variables of ``environ`` whose names say they hold a secret (ANTHROPIC_API_KEY, GH_TOKEN, ...)."""
    return sorted(name for name in environ if SECRET_NAME.search(name))


class HandoverTooLarge(Exception):
    """The secret-looking variables hold more than a pipe can carry."""


@dataclass(frozen=True)
class Handover:
    """The handed-over variables as ``OPALCTL_HANDOVER`` names them for this process."""

    fd: int
    names: tuple[str, ...]

    @classmethod
    def here(cls, environ=None) -> Handover | None:
        """The handover meant for this process (its pid), whose descriptor is still an open pipe; else None."""
        environ = os.environ if environ is None else environ
        words = str(environ.get(HANDOVER) or "").split()
        if len(words) < 2 or not words[0].isdigit() or not words[1].isdigit() or int(words[0]) != os.getpid():
            return None
        fd = int(words[1])
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return None
        except OSError:
            return None
        return cls(fd, tuple(words[2:]))


def reexec_without_secrets(arguments: list[str]) -> None:
    """For ``opalctl run``: when the environment holds secret-looking variables, execute this same program again
    (same pid, arguments and standard streams) without them, their values in an inherited pipe (module
    docstring). Returns only when there is nothing to hand over, or when ``exec`` itself failed (the run then goes
    on as a library caller's would: the host inherits the variables, and the training process removes them)."""
    if arguments[:1] != ["run"]:
        return
    names = secret_names(os.environ)
    if not names:
        return
    payload = json.dumps({name: os.environ[name] for name in names}).encode("utf-8")
    read_end, write_end = os.pipe()
    try:
        _fill(write_end, payload)
    except HandoverTooLarge:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    os.set_inheritable(read_end, True)
    environment = {name: value for name, value in os.environ.items() if name not in names}
    environment[HANDOVER] = " ".join([str(os.getpid()), str(read_end), *names])
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    except OSError:
        os.close(read_end)


def _fill(fd: int, payload: bytes) -> None:
    """Write ``payload`` whole into the pipe ``fd`` without blocking (nobody reads it before the host starts)."""
    if len(payload) > 65536:
        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, len(payload))
        except OSError:
            pass
    os.set_blocking(fd, False)
    written = 0
    try:
        while written < len(payload):
            written += os.write(fd, payload[written:])
    except BlockingIOError:
        raise HandoverTooLarge(f"the secret-looking variables of the environment hold {len(payload)} bytes, more "
                               f"than opalctl can hand to its agent host; unset the ones this run does not need "
                               f"(names: {', '.join(secret_names(os.environ))})") from None


def settle() -> None:
    """In the re-executed process: keep the pipe from every child but the agent host (which gets it through
    ``pass_fds``)."""
    handover = Handover.here()
    if handover is not None:
        os.set_inheritable(handover.fd, False)


def handed_over_names() -> tuple[str, ...]:
    """The names of the variables this process handed over (empty when none, or once released)."""
    handover = Handover.here()
    return handover.names if handover is not None else ()


def release() -> None:
    """Close this process's end of the pipe without reading it, and forget the handover (the agent host, when one
    was started, has its own end)."""
    handover = Handover.here()
    if handover is not None:
        os.close(handover.fd)
    os.environ.pop(HANDOVER, None)


def take(fd: int, environ=None) -> list[str]:
    """In the agent host: read the handed-over variables from ``fd`` into ``environ`` (this process's environment)
    and close it; returns their names. A pipe that holds no valid object gives nothing."""
    environ = os.environ if environ is None else environ
    chunks = []
    try:
        os.set_blocking(fd, True)
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:
        return []
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        values = json.loads(b"".join(chunks).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return []
    if not isinstance(values, dict):
        return []
    taken = [name for name, value in values.items() if isinstance(name, str) and isinstance(value, str)]
    for name in taken:
        environ[name] = values[name]
    return sorted(taken)
