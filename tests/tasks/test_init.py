"""``opalctl init``: the same bytes every time, never an overwrite, and a ready protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from opalctl.errors import BadInput
from opalctl.tasks.builtin import init, protocol_text
from tests import support
from tests.support.cli import call_cli, run_cli

FILES = ["data/digits/development.npz", "data/digits/retention.npz", "data/digits/selection.npz",
         "data/digits/train.npz", "digits.yaml", "parents/digits/seed-1.pt", "parents/digits/seed-2.pt"]


def error_line(stderr: str, prepared: bool = False) -> str:
    """The refusal, the last line of stderr. Before it, only the "preparing ..." line, and only when ``prepared``:
    init validates its input first, so a refusal of the input itself is all that stderr holds."""
    lines = stderr.splitlines()
    assert stderr.endswith("\n") and lines and lines[-1].startswith("opalctl: error: "), stderr
    assert "Traceback" not in stderr
    if prepared:
        assert len(lines) == 2 and lines[0].startswith("preparing digits in "), stderr
    else:
        assert len(lines) == 1, stderr
    return lines[-1]


def test_init_writes_the_protocol_data_and_one_parent_per_seed(digits_init_folder):
    assert sorted(support.tree(digits_init_folder)) == FILES
    assert (digits_init_folder / "digits.yaml").read_text(encoding="utf-8") == protocol_text("digits", [1, 2])


@pytest.mark.slow  # init again in a child process: a dataset and a parent prepared once more
def test_init_is_byte_for_byte_deterministic_across_processes(digits_init_folder, tmp_path):
    """A second init, in another process (another hash seed), writes exactly the same bytes."""
    result = run_cli("init", "digits", "--dir", tmp_path / "again", "--seeds", "1,2", "--json")
    assert result.code == 0, result.output
    assert result.stderr == f"preparing digits in {tmp_path / 'again'} (data files and one parent per seed)...\n"
    body = result.json()
    assert body["written"] == len(FILES) and {f["status"] for f in body["files"]} == {"written"}
    assert sorted(Path(f["path"]).relative_to(tmp_path / "again").as_posix() for f in body["files"]) == FILES
    first, second = support.tree(digits_init_folder), support.tree(tmp_path / "again")
    assert sorted(first) == sorted(second) == FILES
    assert [name for name in FILES if first[name] != second[name]] == []


def test_a_second_init_reports_every_file_unchanged(digits_project):
    before = support.tree(digits_project)
    result = init("digits", digits_project, seeds=[1, 2])
    assert result["written"] == 0
    assert [(Path(f["path"]).relative_to(digits_project).as_posix(), f["status"]) for f in result["files"]] == [
        (name, "unchanged") for name in FILES]
    assert support.tree(digits_project) == before
    assert not [p for p in digits_project.iterdir() if p.name.startswith(".opalctl-init-")]  # no staging left


def test_init_refuses_to_overwrite_a_protocol_with_other_contents(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "digits.yaml").write_text("name: my-own-protocol\n", encoding="utf-8")
    result = call_cli("init", "digits", "--dir", folder, "--seeds", "1,2")
    assert result.code == 2, result.output
    assert f"{folder / 'digits.yaml'} already exists with other contents" in error_line(result.stderr, prepared=True)
    assert (folder / "digits.yaml").read_text(encoding="utf-8") == "name: my-own-protocol\n"
    assert sorted(support.tree(folder)) == ["digits.yaml"]  # nothing else was moved in, no staging left
    assert [p.name for p in folder.iterdir()] == ["digits.yaml"]


def test_init_refuses_to_overwrite_a_changed_parent(digits_project):
    support.flip_byte(digits_project / "parents/digits/seed-2.pt")
    before = support.tree(digits_project)
    with pytest.raises(BadInput, match=r"parents/digits/seed-2\.pt already exist with other contents") as caught:
        init("digits", digits_project, seeds=[1, 2, 3])  # seed 3 is new, yet nothing may be written
    assert caught.value.exit_code == 2
    assert str(digits_project / "digits.yaml") in caught.value.message  # its seeds differ: a conflict too
    assert support.tree(digits_project) == before


def test_the_committed_example_protocol_is_what_init_writes():
    committed = Path(__file__).resolve().parents[2] / "protocols" / "digits.yaml"
    if not committed.exists():
        pytest.skip("protocols/digits.yaml is not committed")
    assert committed.read_text(encoding="utf-8") == protocol_text("digits", [1, 2, 3])


def test_the_protocol_names_the_seeds_given(digits_init_folder):
    assert "seeds: [4, 9, 11]\n" in protocol_text("digits", [4, 9, 11])
    assert "{seeds}" not in protocol_text("digits", [1])


@pytest.mark.parametrize("args, expected", [
    (["init", "nope"], "there is no built-in task 'nope'"),
    (["init", "digits", "--seeds", "1,1"], "--seeds must be distinct"),
    (["init", "digits", "--seeds", "1,-2"], "--seeds must be distinct non-negative"),
    (["init", "digits", "--seeds", "1,x"], "give integers separated by commas"),
    (["init", "digits", "--seeds", "-1"], "--seeds must be distinct non-negative"),
])
def test_init_refuses_bad_input(tmp_path, args, expected):
    result = call_cli(*args, "--dir", tmp_path / "project")
    assert result.code == 2, result.output
    assert expected in error_line(result.stderr)  # one line: nothing was being prepared
    assert result.stdout == ""


def test_init_into_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x", encoding="utf-8")
    result = call_cli("init", "digits", "--dir", target)
    assert result.code == 2
    line = error_line(result.stderr)
    assert "--dir" in line and str(target) in line and "is a file" in line
    with pytest.raises(BadInput, match="is a file; give a folder"):  # the function refuses it as well
        init("digits", target, seeds=[1])
    assert target.read_text(encoding="utf-8") == "x"
