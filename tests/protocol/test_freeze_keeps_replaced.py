"""``freeze --force`` keeps the lock it replaces as ``NAME.lock.SHA12.json``, so the run folders made from it
(``runs/NAME-SHA12``) keep the lock that says what they ran."""

import hashlib

from opalctl.protocol.lock import read_lock
from tests.support.cli import call_cli

LOCK_NAME = "digits.lock.json"


def test_freeze_force_keeps_the_replaced_lock_named_by_its_digest(digits_project):
    protocol = digits_project / "digits.yaml"
    first = call_cli("freeze", protocol, "--json")
    assert first.code == 0, first.output
    lock = digits_project / LOCK_NAME
    before = lock.read_bytes()
    sha12 = hashlib.sha256(before).hexdigest()[:12]
    assert first.json()["sha256"][:12] == sha12
    protocol.write_text(protocol.read_text(encoding="utf-8").replace("seeds: [1, 2]", "seeds: [1]"), encoding="utf-8")

    refused = call_cli("freeze", protocol)
    assert refused.code == 2 and "digits.lock.SHA12.json" in refused.stderr
    assert sorted(p.name for p in digits_project.glob("digits.lock*")) == [LOCK_NAME]

    forced = call_cli("freeze", protocol, "--force")
    assert forced.code == 0, forced.output
    kept = digits_project / f"digits.lock.{sha12}.json"
    assert kept.read_bytes() == before, "the replaced lock is kept byte for byte"
    assert read_lock(kept).sha12 == sha12, "its name is the digest its run folders (runs/digits-SHA12) carry"
    assert lock.read_bytes() != before and read_lock(lock).resolved["seeds"] == [1]
    assert "kept beside it as digits.lock.SHA12.json" in forced.stderr

    # back to the first protocol: the lock replaced now is kept too, and the first one is not written twice
    protocol.write_text(protocol.read_text(encoding="utf-8").replace("seeds: [1]", "seeds: [1, 2]"), encoding="utf-8")
    second = lock.read_bytes()
    again = call_cli("freeze", protocol, "--force", "--json")
    assert again.code == 0 and lock.read_bytes() == before
    names = sorted(p.name for p in digits_project.glob("digits.lock*"))
    assert names == sorted([LOCK_NAME, kept.name, f"digits.lock.{hashlib.sha256(second).hexdigest()[:12]}.json"])
