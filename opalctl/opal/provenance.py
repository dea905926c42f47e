"""Provenance of the agent's defaults: the prompts, the starting programs and the code that writes messages.

A result obtained with an edited prompt is a different experiment. ``defaults/manifest.json`` lists the sha256
of each released default; every agent optimizer compares the files it is about to use with it, records the
outcome as a ``defaults`` event and warns on stderr when one differs. A test fails when the manifest is stale,
so a release cannot ship a prompt that does not match its own manifest. Regenerate it after a deliberate edit:

    python -m opalctl.opal.provenance --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import resources
from pathlib import Path

MANIFEST = "defaults/manifest.json"
FILES = ("prompts/neutral.md", "prompts/aggressive.md", "defaults/updater.py", "defaults/analysis.py", "messages.py")


def _root() -> Path:
    return Path(str(resources.files("opalctl.opal")))


def current() -> dict[str, str]:
    root = _root()
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in FILES}


def expected() -> dict[str, str]:
    path = _root() / MANIFEST
    return json.loads(path.read_text(encoding="utf-8"))["sha256"] if path.exists() else {}


def differences() -> dict[str, str]:
    """File -> "changed" / "not in the manifest" for every default that differs from the released one."""
    want, have = expected(), current()
    out = {}
    for name, digest in have.items():
        if name not in want:
            out[name] = "not in the manifest"
        elif want[name] != digest:
            out[name] = "changed"
    return out


def write() -> Path:
    path = _root() / MANIFEST
    text = json.dumps({"sha256": current()}, indent=2, sort_keys=True) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print(f"wrote {write()}")
    else:
        changed = differences()
        print(json.dumps(changed or "all defaults match the manifest", indent=2))
        sys.exit(1 if changed else 0)
