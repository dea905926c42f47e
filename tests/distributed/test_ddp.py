"""The agent optimizer under real ``torchrun --nproc_per_node 2`` (gloo, CPU): one launch runs every scenario of
``ddp_worker.py``; each test reads what the two ranks reported and what rank 0's agent recorded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from opalctl.formats import Event, read_jsonl
from opalctl.opal.slots import version_digest

WORKER = Path(__file__).with_name("ddp_worker.py")


def load_worker():
    """``ddp_worker.py`` as a module (the tests folders are not packages)."""
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("ddp")
    return out, load_worker().launch(out, "gloo")


def events(folder: Path, kind: str) -> list[dict]:
    return [event for event in read_jsonl(folder / "events.jsonl") if event["kind"] == kind]


def test_keep_under_torchrun_is_bit_for_bit_the_plain_ddp_run_on_both_ranks(ranks):
    _, seen = ranks
    for rank in seen:
        assert rank["keep"] == {"bit_for_bit": True, "same_on_every_rank": True}


def test_a_heuristic_decision_on_rank_0_applies_on_both_ranks_at_the_same_update(ranks):
    out, seen = ranks
    applied = events(out / "heuristic", Event.APPLIED)
    assert applied, "the heuristic changed nothing: the scenario tests no relay"
    programs = out / "heuristic" / "programs"
    expected = [[event["update"], version_digest({name: (programs / f"v{event['version']:03d}" / name).read_text(
        encoding="utf-8") for name in ("updater.py", "analysis.py")})] for event in applied]
    for rank in seen:
        assert rank["heuristic"]["installed"] == expected
        assert rank["heuristic"]["version"] == applied[-1]["version"]
        assert rank["heuristic"]["same_on_every_rank"] and rank["heuristic"]["differs_from_keep"]
    assert not (out / "heuristic" / "rank-1").exists()  # the agent and its records are rank 0's alone


def test_a_program_failure_on_rank_1_alone_reverts_the_version_on_both_ranks_at_that_update(ranks):
    out, seen = ranks
    for rank in seen:
        failure = rank["failure"]
        assert failure["reverts"] == [[seen[0]["failure"]["installed"][0][0] + 1, [1]]]
        assert failure["version"] == 0 and failure["statuses"] == ["passed", "failed"]
        assert failure["same_on_every_rank"]
    reverted = events(out / "failure", Event.REVERTED)
    assert [(event["update"], event["version"], event["to"]) for event in reverted] == [
        (seen[0]["failure"]["reverts"][0][0], 1, 0)]
    assert "rank 1: out of memory on this rank's device (simulated)" in reverted[0]["message"]


def test_a_weight_changed_on_one_rank_stops_both_ranks_loudly_at_the_next_fingerprint_check(ranks):
    _, seen = ranks
    for rank in seen:
        stopped = rank["divergence"]["stopped"]
        assert stopped is not None and rank["divergence"]["exit_code"] == 1
        assert stopped.startswith("rank 1's parameter '2.weight' differs from rank 0's at update 8 ")
        assert "training stops" in stopped and "\n" not in stopped


def test_a_plain_wrap_in_a_process_group_refuses_naming_wrap_distributed(ranks):
    """Before, each rank started an agent of its own into one folder (8 decisions asked for 4 scheduled)."""
    _, seen = ranks
    for rank in seen:
        refused = rank["plain_wrap"]["refused"]
        assert refused is not None and "\n" not in refused
        assert refused.startswith("wrap() in a process group of 2 ranks would run one agent per rank")
        assert "opalctl.opal.wrap_distributed" in refused
        assert rank["plain_wrap"]["folder_made"] is False
