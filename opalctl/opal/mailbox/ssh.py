"""A mailbox folder on another machine, reached through the user's own ``ssh`` client.

``SshMailboxFolder("HOST:DIR")`` does each operation of ``MailboxFolder`` as one short POSIX ``sh`` command run on
HOST in DIR, so nothing is installed there: no daemon, no Python. HOST is anything the user's ``ssh`` accepts (an
alias of ``~/.ssh/config``, ``user@host``, a jump host through ``ProxyJump`` in that config); DIR is absolute, or
relative to the remote home (``~/DIR`` too), and must exist. Keys, agents and jump hosts are ssh's business:
opalctl passes ``-o BatchMode=yes`` (never a prompt for a password or a host key; an unknown host key is refused as
ssh refuses it) and nothing else of its own but the multiplexing below.

**One handshake.** The first operation starts a master connection (``ControlMaster``) whose socket lies in a private
folder of this process (mode 0700); every operation after it is a session on that connection, so it pays no new
handshake. The master ends after ``CONTROL_PERSIST_SECONDS`` idle (so one left by a killed process goes by
itself), is started again when it has gone, and ``close`` ends it and removes its folder. At most
``MAX_SESSIONS`` operations run at once (sshd's ``MaxSessions`` is 10 by default and refuses more).

**Options.** ``config`` is passed as ``ssh -F FILE`` (by default ``$OPALCTL_SSH_CONFIG`` where set, else ssh's own
``~/.ssh/config``), and each of ``options`` as ``-o OPTION`` (``"Port=2222"``): the tests reach a loopback sshd so.

**Quoting, and hostile remote states.** Every path is checked here (relative, '/'-separated, no '..', no empty or
'.' part) and shell-quoted (``shlex.quote``) into the command, which runs as ``sh -c '...'`` under the remote login
shell (any shell that reads single quotes as sh does: sh, bash, zsh, ksh, dash). The command checks that no part of
the path is a link (``MailboxRefusal`` otherwise) before it follows it; ``read`` refuses a link, a FIFO or a device
(it never opens one: a FIFO would block) and transfers at most ``limit + 1`` bytes (``head -c``); ``create`` writes
a temporary '.' file in the same folder and hard-links it (``ln`` without ``-f``: link(2) fails on any existing
name, so two servers never both create one lease); ``replace`` renames a temporary file over the name (a link in
its place is replaced, never followed). What the remote side can still do between a check and the read (swap a
file for a FIFO) ends in the operation's time limit, never in a read past the limit.

**Errors.** A host that cannot be reached, a login refused, a DIR that is missing, a remote command that fails
(permission denied) are each one sentence naming the target (``SshMailboxError``, exit 1).
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence

from opalctl.errors import BadInput, OpalctlError
from opalctl.opal.mailbox.folder import MailboxRefusal

CONFIG_VARIABLE = "OPALCTL_SSH_CONFIG"
CONTROL_PERSIST_SECONDS = 300
CONNECT_TIMEOUT_SECONDS = 20
OPERATION_SECONDS = 120.0
MAX_SESSIONS = 8
SOCKET_PATH_MAX = 90  # a unix socket's path is at most 107 bytes; ssh adds a random suffix while it binds

# the remote command's exit codes for what is not a failure of the command itself (ssh keeps 255 for its own)
_ROOT_MISSING, _LINK, _NOT_REGULAR, _EXISTS, _ABSENT, _FOLDER_MISSING = 90, 91, 92, 93, 94, 95

_UNREACHABLE = ("could not resolve", "connection refused", "timed out", "no route to host",
                "network is unreachable", "connection closed", "connection reset", "name or service not known")


class SshMailboxError(OpalctlError):
    """The mailbox over ssh could not be used: the host unreachable, the login refused, the folder missing, a remote
    command that failed. One sentence naming the target (exit 1)."""


def split_target(target: str) -> tuple[str, str]:
    """``HOST:DIR`` as (HOST, DIR); a bracketed IPv6 host (``[::1]:DIR``) keeps its colons."""
    if not isinstance(target, str):
        raise BadInput(f"ssh target {target!r} is not HOST:DIR")
    if target.startswith("["):
        end = target.find("]")
        host, rest = (target[1:end], target[end + 1:]) if end > 0 else ("", target)
        directory = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, directory = target.partition(":")
    if not host or not directory:
        raise BadInput(f"ssh target {target!r} is not HOST:DIR (a host as ssh accepts it, a colon, then the "
                       f"mailbox folder on that host)")
    if host.startswith("-") or any(c.isspace() or c == "\0" for c in host):
        raise BadInput(f"ssh target {target!r}: the host {host!r} is not a host name (it starts with '-' or holds "
                       f"a space)")
    if "\0" in directory:
        raise BadInput(f"ssh target {target!r}: the folder holds a NUL byte")
    return host, directory


def path_parts(path: str, *, root_allowed: bool = False) -> list[str]:
    """The parts of a mailbox path; ``MailboxRefusal`` for an absolute path, '..', an empty or '.' part."""
    if not isinstance(path, str):
        raise MailboxRefusal(f"mailbox path {path!r} is not text")
    if root_allowed and path in ("", "."):
        return []
    parts = path.split("/")
    if path.startswith("/") or "\0" in path or any(part in ("", ".", "..") for part in parts):
        raise MailboxRefusal(f"mailbox path {path!r} is refused: it must be relative to the mailbox, '/'-separated, "
                             f"without '..', '.' or empty parts")
    return parts


def _remote_root(directory: str) -> str:
    """DIR as a shell word: ``~`` and ``~/...`` under the remote ``$HOME``, anything else quoted as it is."""
    if directory == "~":
        return '"$HOME"'
    if directory.startswith("~/"):
        rest = directory[2:]
        return '"$HOME"' + ("/" + shlex.quote(rest) if rest else "")
    return shlex.quote(directory)


def _no_links(parts: list[str], *, last: bool) -> str:
    """The command that exits ``_LINK`` (naming the path on stderr) when a prefix of ``parts`` is a link; with
    ``last`` the whole path too."""
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + (1 if last else 0))]
    if not prefixes:
        return ":"
    words = " ".join(shlex.quote(prefix) for prefix in prefixes)
    return f'for p in {words}; do if [ -L "$p" ]; then echo "$p" >&2; exit {_LINK}; fi; done'


def _control_folder() -> str:
    base = tempfile.gettempdir()
    if len(base) + 30 > SOCKET_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="opalctl-ssh-", dir=base)


def _end_master(command: list[str], folder: str) -> None:
    """End the master connection of ``folder`` and remove the folder (a finalizer: holds no reference to the
    mailbox)."""
    if os.path.exists(os.path.join(folder, "master")):
        try:
            subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=CONNECT_TIMEOUT_SECONDS)
        except (OSError, subprocess.SubprocessError):
            pass
    shutil.rmtree(folder, ignore_errors=True)


class SshMailboxFolder:
    """``MailboxFolder`` over ssh on ``target`` (``HOST:DIR``); the module docstring says how."""

    def __init__(self, target: str, *, config: str | os.PathLike | None = None, options: Sequence[str] = (),
                 ssh: str = "ssh", timeout: float = OPERATION_SECONDS):
        self.target = target
        self.where = target  # MailboxFolder's name of it, in the mailbox's and the server's messages
        self.host, self.directory = split_target(target)
        config = config if config is not None else os.environ.get(CONFIG_VARIABLE) or None
        self.config = os.fspath(config) if config is not None else None
        self.options = [str(option) for option in options]
        self.ssh = ssh
        self.timeout = float(timeout)
        self._control: str | None = None  # the private folder of the master's socket, made by the first operation
        self._socket = ""
        self._finalizer: weakref.finalize | None = None
        self._master_lock = threading.Lock()
        self._sessions = threading.BoundedSemaphore(MAX_SESSIONS)

    def __repr__(self) -> str:
        return f"SshMailboxFolder({self.target!r})"

    def __enter__(self) -> SshMailboxFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the master connection and remove its private folder (a later operation starts a new one)."""
        with self._master_lock:
            if self._finalizer is not None:
                self._finalizer()
            self._control, self._socket, self._finalizer = None, "", None

    # -- running one command -----------------------------------------------------------------------------------
    def _command(self, *arguments: str) -> list[str]:
        command = [self.ssh]
        if self.config is not None:
            command += ["-F", self.config]
        for option in self.options:
            command += ["-o", option]
        command += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_SECONDS}",
                    "-o", f"ControlPath={self._socket}"]
        return command + [*arguments, "--", self.host]

    def _ssh_failure(self, stderr: bytes) -> SshMailboxError:
        lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
        said = lines[-1] if lines else "no message"
        lowered = said.lower()
        if "permission denied" in lowered:
            return SshMailboxError(f"ssh mailbox {self.target}: the login to {self.host} was refused ({said}); check "
                                   f"the key ssh offers for it (opalctl runs ssh with BatchMode=yes: no password "
                                   f"prompt)")
        if "host key verification failed" in lowered:
            return SshMailboxError(f"ssh mailbox {self.target}: the host key of {self.host} is not known or has "
                                   f"changed ({said}); connect once with `ssh {self.host}` to check and accept it")
        if any(word in lowered for word in _UNREACHABLE):
            return SshMailboxError(f"ssh mailbox {self.target}: the host {self.host} cannot be reached ({said})")
        return SshMailboxError(f"ssh mailbox {self.target}: ssh to {self.host} failed ({said})")

    def _ensure_master(self) -> None:
        with self._master_lock:
            if self._control is None:
                self._control = _control_folder()
                self._socket = os.path.join(self._control, "master")
                self._finalizer = weakref.finalize(self, _end_master, self._command("-O", "exit"), self._control)
            if os.path.exists(self._socket):
                return
            command = self._command("-o", "ControlMaster=yes", "-o", f"ControlPersist={CONTROL_PERSIST_SECONDS}")
            errors = os.path.join(self._control, "master.err")
            try:
                with open(errors, "wb") as stderr:
                    completed = subprocess.run(command + ["true"], stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=stderr,
                                               timeout=CONNECT_TIMEOUT_SECONDS + 10)
            except FileNotFoundError:
                raise SshMailboxError(f"ssh mailbox {self.target}: there is no ssh client {self.ssh!r} on this "
                                      f"machine (install openssh-client)") from None
            except subprocess.TimeoutExpired:
                raise SshMailboxError(f"ssh mailbox {self.target}: the host {self.host} did not answer within "
                                      f"{CONNECT_TIMEOUT_SECONDS + 10} s") from None
            if completed.returncode != 0:
                with open(errors, "rb") as stderr:
                    raise self._ssh_failure(stderr.read())

    def _run(self, script: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        """Run ``script`` in DIR on the host: (its exit code, its stdout); an ssh failure, a missing DIR or an exit
        code that is not one of the module's is ``SshMailboxError``, a link on the path ``MailboxRefusal``."""
        root = _remote_root(self.directory)
        whole = (f"if [ ! -d {root} ]; then exit {_ROOT_MISSING}; fi; cd {root} || exit 1; {script}")
        self._ensure_master()
        command = self._command("-o", "ControlMaster=no") + ["sh -c " + shlex.quote(whole)]
        feed = {"input": data} if data is not None else {"stdin": subprocess.DEVNULL}
        with self._sessions:
            try:
                completed = subprocess.run(command, capture_output=True, timeout=self.timeout, **feed)
            except FileNotFoundError:
                raise SshMailboxError(f"ssh mailbox {self.target}: there is no ssh client {self.ssh!r} on this "
                                      f"machine (install openssh-client)") from None
            except subprocess.TimeoutExpired:
                raise SshMailboxError(f"ssh mailbox {self.target}: the operation on {path!r} did not end within "
                                      f"{self.timeout:g} s and was stopped") from None
        code = completed.returncode
        said = completed.stderr.decode(errors="replace").strip().splitlines()
        if code == 255:
            raise self._ssh_failure(completed.stderr)
        if code == _ROOT_MISSING:
            raise SshMailboxError(f"ssh mailbox {self.target}: the folder {self.directory} is missing on {self.host} "
                                  f"(make it there, or name another one)")
        if code == _LINK:
            where = said[-1] if said else path
            raise MailboxRefusal(f"ssh mailbox {self.target}: {where!r} is a link; refused (a mailbox holds plain "
                                 f"files and folders only)")
        if code == _NOT_REGULAR:
            raise MailboxRefusal(f"ssh mailbox {self.target}: {path!r} is not a regular file; refused")
        if code == _FOLDER_MISSING:
            raise SshMailboxError(f"ssh mailbox {self.target}: the folder of {path!r} is missing or not a folder "
                                  f"(make it first)")
        if code not in (0, _EXISTS, _ABSENT):
            reason = said[-1] if said else f"exit code {code}"
            raise SshMailboxError(f"ssh mailbox {self.target}: the command on {path!r} failed on {self.host} "
                                  f"({reason})")
        return code, completed.stdout

    @staticmethod
    def _temporary(parts: list[str]) -> str:
        """A '.' name beside the last part (never listed by ``names``), random so that no two writers share it."""
        name = f".{parts[-1][:100]}.{secrets.token_hex(8)}.tmp"
        return "/".join([*parts[:-1], name])

    @staticmethod
    def _folder_there(parts: list[str]) -> str:
        folder = "/".join(parts[:-1])
        return f"if [ ! -d {shlex.quote(folder)} ]; then exit {_FOLDER_MISSING}; fi; " if folder else ""

    # -- MailboxFolder ---------------------------------------------------------------------------------------------
    def names(self, sub: str) -> list[str]:
        parts = path_parts(sub, root_allowed=True)
        folder = shlex.quote("/".join(parts)) if parts else "."
        # '/' separates the names: no file name holds one
        script = (f"{_no_links(parts, last=True)}; if [ ! -e {folder} ]; then exit 0; fi; "
                  f"if [ ! -d {folder} ]; then exit {_NOT_REGULAR}; fi; cd {folder} || exit 1; "
                  f'for f in *; do if [ -f "$f" ] && [ ! -L "$f" ]; then printf "%s/" "$f"; fi; done')
        _, out = self._run(script, sub)
        names = [os.fsdecode(name) for name in out.split(b"/") if name]
        return sorted(name for name in names if not name.startswith("."))

    def read(self, path: str, limit: int) -> bytes | None:
        parts = path_parts(path)
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit {limit!r} is not a byte count")
        target = shlex.quote("/".join(parts))
        script = (f"{_no_links(parts, last=True)}; if [ ! -e {target} ]; then exit {_ABSENT}; fi; "
                  f"if [ ! -f {target} ]; then exit {_NOT_REGULAR}; fi; exec head -c {limit + 1} -- {target}")
        code, out = self._run(script, path)
        if code == _ABSENT:
            return None
        if len(out) > limit:
            raise MailboxRefusal(f"ssh mailbox {self.target}: {path!r} is over its limit of {limit} bytes; refused")
        return out

    def create(self, path: str, data: bytes) -> bool:
        parts = path_parts(path)
        target, temporary = shlex.quote("/".join(parts)), shlex.quote(self._temporary(parts))
        script = (f"{_no_links(parts, last=False)}; {self._folder_there(parts)}"
                  f"if [ -e {target} ] || [ -L {target} ]; then exit {_EXISTS}; fi; "
                  f"set -C; cat > {temporary} || {{ rm -f -- {temporary}; exit 1; }}; "
                  f"if ln -- {temporary} {target} 2>/dev/null; then rm -f -- {temporary}; exit 0; fi; "
                  f"rm -f -- {temporary}; if [ -e {target} ] || [ -L {target} ]; then exit {_EXISTS}; fi; "
                  f"echo 'cannot make a hard link in the mailbox folder' >&2; exit 1")
        code, _ = self._run(script, path, data=bytes(data))
        return code == 0

    def replace(self, path: str, data: bytes) -> None:
        parts = path_parts(path)
        target, temporary = shlex.quote("/".join(parts)), shlex.quote(self._temporary(parts))
        script = (f"{_no_links(parts, last=False)}; {self._folder_there(parts)}"
                  f"if [ -d {target} ] && [ ! -L {target} ]; then exit {_NOT_REGULAR}; fi; "
                  f"set -C; cat > {temporary} || {{ rm -f -- {temporary}; exit 1; }}; "
                  f"if [ -L {target} ]; then rm -f -- {target}; fi; "
                  f"mv -f -- {temporary} {target} || {{ rm -f -- {temporary}; exit 1; }}")
        self._run(script, path, data=bytes(data))

    def remove(self, path: str) -> None:
        parts = path_parts(path)
        target = shlex.quote("/".join(parts))
        script = (f"{_no_links(parts, last=False)}; "
                  f"if [ -d {target} ] && [ ! -L {target} ]; then exit {_NOT_REGULAR}; fi; rm -f -- {target}")
        self._run(script, path)

    def makedirs(self, sub: str) -> None:
        parts = path_parts(sub, root_allowed=True)
        if not parts:
            self._run(":", sub)
            return
        script = f"{_no_links(parts, last=True)}; mkdir -p -- {shlex.quote('/'.join(parts))}"
        self._run(script, sub)
