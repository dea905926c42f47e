"""The mailbox folder over ssh (opalctl/opal/mailbox/ssh.py), against a real sshd on loopback (the ``sshd`` fixture).

The server runs on this machine, so each test checks what an operation did by looking at the folder itself, and
plants what a hostile remote side could leave there (a link where an answer goes, an oversized file, a FIFO)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from opalctl.opal.mailbox.folder import MailboxRefusal
from opalctl.opal.mailbox.ssh import SshMailboxError, SshMailboxFolder

ODD = "it's a \"dir\" $HOME `x`; rm -rf y"  # spaces, both quotes, a variable, backquotes, a ';'


@pytest.fixture
def mailbox(sshd, tmp_path):
    root = tmp_path / "mailbox"
    root.mkdir()
    folder = SshMailboxFolder(sshd.target(root), config=sshd.config)
    yield folder, root
    folder.close()


def test_every_operation_round_trips(mailbox):
    folder, root = mailbox
    folder.makedirs("requests/run-1")
    assert (root / "requests" / "run-1").is_dir()
    assert folder.names("requests/run-1") == []
    assert folder.create("requests/run-1/001.json", b'{"id": 1}\n') is True
    assert (root / "requests/run-1/001.json").read_bytes() == b'{"id": 1}\n'
    assert folder.create("requests/run-1/001.json", b"other") is False  # exists: left as it was
    assert (root / "requests/run-1/001.json").read_bytes() == b'{"id": 1}\n'
    assert folder.read("requests/run-1/001.json", 100) == b'{"id": 1}\n'
    assert folder.read("requests/run-1/002.json", 100) is None
    folder.replace("requests/run-1/001.json", b"\x00binary\xff" * 3)
    assert folder.read("requests/run-1/001.json", 100) == b"\x00binary\xff" * 3
    folder.replace("requests/run-1/new.json", b"")  # replace makes a missing file too
    assert folder.read("requests/run-1/new.json", 0) == b""
    assert folder.names("requests/run-1") == ["001.json", "new.json"]
    folder.remove("requests/run-1/001.json")
    folder.remove("requests/run-1/001.json")  # missing is fine
    assert folder.names("requests/run-1") == ["new.json"]
    assert folder.names("answers") == []  # a missing folder has no names
    assert sorted(os.listdir(root / "requests/run-1")) == ["new.json"]  # no temporary file left behind


def test_names_lists_regular_files_only(mailbox):
    folder, root = mailbox
    (root / "box").mkdir()
    (root / "box" / "a.json").write_text("a")
    (root / "box" / ".hidden.tmp").write_text("h")
    (root / "box" / "folder").mkdir()
    (root / "box" / "link.json").symlink_to(root / "box" / "a.json")
    os.mkfifo(root / "box" / "fifo.json")
    (root / "box" / "with\nnewline").write_text("n")
    assert folder.names("box") == ["a.json", "with\nnewline"]
    assert folder.names("") == []  # the root holds only a folder


def test_paths_with_spaces_and_quotes_are_quoted(sshd, tmp_path):
    root = tmp_path / ODD
    root.mkdir()
    with SshMailboxFolder(sshd.target(root), config=sshd.config) as folder:
        folder.makedirs(f"{ODD}/sub dir")
        name = f"{ODD}/sub dir/it's \"here\" $(touch pwned).json"
        assert folder.create(name, b"data") is True
        assert (root / name).read_bytes() == b"data"
        assert folder.names(f"{ODD}/sub dir") == ["it's \"here\" $(touch pwned).json"]
        assert folder.read(name, 10) == b"data"
        folder.replace(name, b"more")
        assert (root / name).read_bytes() == b"more"
        folder.remove(name)
        assert not (root / name).exists()
    assert not any(path.name == "pwned" for path in tmp_path.rglob("*"))


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside", "a/../../b", "a//b", "./a", ""])
def test_paths_outside_the_mailbox_are_refused_before_any_ssh(path, tmp_path):
    folder = SshMailboxFolder("nohost:/nowhere", ssh=str(tmp_path / "no-ssh-here"))
    for call in (lambda: folder.read(path, 10), lambda: folder.create(path, b"x"), lambda: folder.remove(path),
                 lambda: folder.replace(path, b"x")):
        with pytest.raises(MailboxRefusal, match="relative to the mailbox"):
            call()


def test_a_link_planted_in_place_of_an_answer_is_refused(mailbox, tmp_path):
    folder, root = mailbox
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the mailbox")
    (root / "answers").mkdir()
    (root / "answers" / "001.json").symlink_to(secret)
    with pytest.raises(MailboxRefusal, match="'answers/001.json' is a link"):
        folder.read("answers/001.json", 1000)
    assert folder.create("answers/001.json", b"x") is False  # a link is a name taken
    folder.replace("answers/001.json", b"answer")  # the link itself is replaced, never followed
    assert not (root / "answers" / "001.json").is_symlink()
    assert (root / "answers" / "001.json").read_bytes() == b"answer"
    assert secret.read_text() == "not for the mailbox"


def test_a_link_on_the_way_to_a_file_is_refused(mailbox, tmp_path):
    folder, root = mailbox
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "001.json").write_text("outside")
    (root / "answers").symlink_to(elsewhere)
    for call in (lambda: folder.read("answers/001.json", 100), lambda: folder.names("answers"),
                 lambda: folder.create("answers/002.json", b"x"), lambda: folder.replace("answers/001.json", b"x"),
                 lambda: folder.remove("answers/001.json"), lambda: folder.makedirs("answers/deeper")):
        with pytest.raises(MailboxRefusal, match="'answers' is a link"):
            call()
    assert sorted(os.listdir(elsewhere)) == ["001.json"]
    assert (elsewhere / "001.json").read_text() == "outside"


def test_a_fifo_or_a_folder_is_not_read(mailbox):
    folder, root = mailbox
    os.mkfifo(root / "answer.json")  # opening it would block: it is never opened
    (root / "folder.json").mkdir()
    started = time.monotonic()
    with pytest.raises(MailboxRefusal, match="'answer.json' is not a regular file"):
        folder.read("answer.json", 100)
    with pytest.raises(MailboxRefusal, match="'folder.json' is not a regular file"):
        folder.read("folder.json", 100)
    with pytest.raises(MailboxRefusal, match="not a regular file"):
        folder.replace("folder.json", b"x")
    with pytest.raises(MailboxRefusal, match="not a regular file"):
        folder.remove("folder.json")
    assert time.monotonic() - started < 30


def test_an_oversized_file_is_refused_having_moved_at_most_its_limit_and_one_byte(sshd, tmp_path):
    root = tmp_path / "mailbox"
    root.mkdir()
    with open(root / "answer.json", "wb") as big:
        big.truncate(64 << 20)  # 64 MiB (sparse)
    counts = tmp_path / "stdout-bytes"
    counting_ssh = tmp_path / "counting-ssh"  # the real ssh, counting the bytes it hands over
    counting_ssh.write_text(f'#!/bin/sh\nout=$(mktemp)\nssh "$@" > "$out"\ncode=$?\nwc -c < "$out" >> {counts}\n'
                            f'cat "$out"\nrm -f "$out"\nexit $code\n')
    counting_ssh.chmod(0o755)
    with SshMailboxFolder(sshd.target(root), config=sshd.config, ssh=str(counting_ssh)) as folder:
        with pytest.raises(MailboxRefusal, match="over its limit of 1000 bytes"):
            folder.read("answer.json", 1000)
        (root / "small.json").write_bytes(b"y" * 1000)
        assert folder.read("small.json", 1000) == b"y" * 1000  # exactly the limit is fine
    moved = [int(line) for line in counts.read_text().split()]
    assert max(moved) == 1001, moved


def test_only_one_of_many_concurrent_creates_wins(mailbox):
    folder, root = mailbox
    folder.makedirs("leases")
    results: dict[int, bool] = {}

    def take(number: int) -> None:
        results[number] = folder.create("leases/001.lease", f"server-{number}".encode())

    threads = [threading.Thread(target=take, args=(number,)) for number in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [number for number, won in results.items() if won]
    assert len(winners) == 1, results
    assert (root / "leases/001.lease").read_bytes() == f"server-{winners[0]}".encode()
    assert os.listdir(root / "leases") == ["001.lease"]


def test_operations_share_one_connection_and_close_ends_it(mailbox, sshd):
    folder, root = mailbox
    before = sshd.log.count("Accepted publickey")
    folder.makedirs("a")
    control = folder._control
    assert control is not None and os.path.exists(os.path.join(control, "master"))
    assert (os.stat(control).st_mode & 0o777) == 0o700
    for number in range(6):
        folder.replace(f"a/{number}", b"x")
        folder.read(f"a/{number}", 10)
    assert sshd.log.count("Accepted publickey") == before + 1  # one handshake for thirteen operations
    folder.close()
    assert not os.path.exists(control)
    assert folder.names("a") == [str(n) for n in range(6)]  # a later operation connects again
    folder.close()


def test_the_config_comes_from_the_environment(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("OPALCTL_SSH_CONFIG", str(sshd.config))
    with SshMailboxFolder(sshd.target(tmp_path)) as folder:
        assert folder.create("x.json", b"1") is True
    assert (tmp_path / "x.json").read_bytes() == b"1"


def test_a_missing_remote_folder_is_one_sentence(sshd, tmp_path):
    with SshMailboxFolder(sshd.target(tmp_path / "absent"), config=sshd.config) as folder:
        with pytest.raises(SshMailboxError, match=f"the folder {tmp_path / 'absent'} is missing on opalctl-loopback"):
            folder.names("requests")


def test_an_unreachable_host_is_one_sentence(sshd, tmp_path):
    config = tmp_path / "ssh_config"
    closed = subprocess.run(["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                             "print(s.getsockname()[1])"], capture_output=True, text=True).stdout.strip()
    config.write_text(sshd.config.read_text().replace(f"Port {sshd.port}", f"Port {closed}"))
    with SshMailboxFolder(sshd.target(tmp_path), config=config) as folder:
        with pytest.raises(SshMailboxError) as refused:
            folder.names("requests")
    assert str(refused.value).startswith(f"ssh mailbox opalctl-loopback:{tmp_path}: the host opalctl-loopback "
                                         f"cannot be reached (")
    assert "Connection refused" in str(refused.value)


def test_a_refused_login_is_one_sentence(sshd, tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "stranger")], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(sshd.config.read_text().replace(str(sshd.folder / "client_key"), str(tmp_path / "stranger")))
    with SshMailboxFolder(sshd.target(tmp_path), config=config) as folder:
        with pytest.raises(SshMailboxError, match="the login to opalctl-loopback was refused .*Permission denied"):
            folder.read("x", 10)


def test_no_ssh_client_is_one_sentence(tmp_path):
    with SshMailboxFolder("somewhere:/box", ssh=str(tmp_path / "no-ssh")) as folder:
        with pytest.raises(SshMailboxError, match="there is no ssh client"):
            folder.names("requests")


@pytest.mark.parametrize("target", ["no-colon", ":/dir", "host:", "-oProxyCommand=x:/dir", "a host:/dir"])
def test_a_target_that_is_not_host_dir_is_refused(target):
    from opalctl.errors import BadInput

    with pytest.raises(BadInput, match="ssh target"):
        SshMailboxFolder(target)



def test_writing_into_a_missing_folder_is_one_sentence(mailbox):
    folder, root = mailbox
    (root / "a-file").write_text("x")
    for path in ("absent/001.json", "a-file/001.json"):
        with pytest.raises(SshMailboxError, match=f"the folder of '{path}' is missing or not a folder"):
            folder.create(path, b"x")
        with pytest.raises(SshMailboxError, match="is missing or not a folder"):
            folder.replace(path, b"x")
    assert sorted(os.listdir(root)) == ["a-file"]


def test_a_mailbox_over_ssh_names_its_target_in_what_the_server_shows_and_refuses(mailbox, sshd):
    """The box and ``agent serve`` name a folder by ``where`` (MailboxFolder): over ssh it is HOST:DIR."""
    from opalctl.formats import RecordDamaged
    from opalctl.opal.mailbox.box import Mailbox
    from opalctl.opal.mailbox.serve import Server

    folder, root = mailbox
    box = Mailbox(folder)
    box.prepare()
    (root / "requests" / "r1.json").write_text("{not json")
    with pytest.raises(RecordDamaged, match=f"{sshd.target(root)}/requests/r1.json"):
        box.request("r1")
    (root / "requests" / "r1.json").unlink()
    shown: list[dict] = []
    server = Server(folder, "anthropic", show=shown.append, poll_seconds=0.05)
    serving = threading.Thread(target=server.serve)
    serving.start()
    deadline = time.monotonic() + 60
    while not shown and serving.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stopping.set()
    serving.join(timeout=60)
    assert shown and shown[0]["event"] == "serving" and shown[0]["mailbox"] == sshd.target(root)
