"""driver/ranks.py without torchrun: the reduction rule each clock declares, the refusals of a world that is not
the protocol's, the single-process world that wraps nothing, and the seeds of the ranks' samplers."""

from __future__ import annotations

import pytest
import torch

from opalctl.driver.budget import CLOCKS, clock_spec
from opalctl.driver.ranks import Ranks, join, rank_seed, world_from
from opalctl.driver.run import RunCommand, rank_state
from opalctl.errors import BadInput, OpalctlError
from opalctl.opal.distributed import wrap_distributed

COMMAND = "torchrun --nproc-per-node 2 -m opalctl run lock.json --arm a --seed 1"


def test_every_clock_declares_how_its_charges_combine_over_ranks():
    assert {name: clock_spec(name).combine for name in CLOCKS} == {
        "cpu": "sum", "gpu": "max", "wall": "max", "updates": "max"}


def test_a_protocol_of_two_ranks_outside_torchrun_is_refused_giving_the_torchrun_command():
    with pytest.raises(BadInput) as caught:
        world_from({}, 2, COMMAND)
    assert caught.value.message.endswith(f"run `{COMMAND}`") and "training.ranks is 2" in caught.value.message


def test_a_torchrun_world_other_than_the_protocols_is_refused():
    with pytest.raises(BadInput, match="training.ranks is 2.*world of 3"):
        world_from({"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "RANK": "0"}, 2, COMMAND)


def test_two_torchrun_processes_for_a_protocol_of_one_rank_are_refused():
    with pytest.raises(BadInput, match="training.ranks is 1 but torchrun started 2 processes"):
        world_from({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}, 1, COMMAND)


def test_a_world_spread_over_two_nodes_is_refused():
    with pytest.raises(BadInput, match="one node.*LOCAL_WORLD_SIZE is 1 of a world of 2"):
        world_from({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "1"}, 2, COMMAND)


def test_the_protocols_world_under_torchrun_gives_this_processs_rank():
    assert world_from({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}, 2, COMMAND) == (1, 2)


def test_a_single_process_run_joins_a_world_of_one_that_wraps_neither_the_clock_nor_the_model():
    class Training:
        ranks, device = 1, "cpu"

    class Protocol:
        training = Training()

    ranks = join(Protocol(), COMMAND, environ={})
    clock, model = object(), object()
    assert type(ranks) is Ranks and (ranks.rank, ranks.world, ranks.lead) == (0, 1, True)
    assert ranks.reduced(clock, "sum") is clock and ranks.for_update(model) is model
    assert ranks.gather("state") == ["state"] and ranks.answer_of_lead(lambda: 7) == 7


def test_rank_0s_sampler_seed_is_the_runs_seed_and_other_ranks_draw_their_own():
    assert rank_seed(3, 0) == 3
    seeds = [rank_seed(3, rank) for rank in range(1, 8)] + [rank_seed(4, 1)]
    assert len(set(seeds)) == len(seeds) and 3 not in seeds
    assert rank_seed(3, 1) == rank_seed(3, 1)


def test_the_command_that_continues_a_two_rank_run_is_the_torchrun_one():
    command = RunCommand("lock.json", "a", 1, ranks=2)
    assert command.line("--resume") == f"{COMMAND} --resume"
    assert RunCommand("lock.json", "a", 1).line() == "opalctl run lock.json --arm a --seed 1"


def test_a_resume_checkpoint_of_another_world_is_refused_naming_resume_pt(tmp_path):
    states = [{"sampler": {}, "rng": {}}, {"sampler": {}, "rng": {}}]
    with pytest.raises(BadInput) as caught:
        rank_state(tmp_path / "resume.pt", states, ranks=Ranks())
    assert str(tmp_path / "resume.pt") in caught.value.message and "2 rank(s)" in caught.value.message


def test_wrap_distributed_takes_a_progress_callable_only_when_told_it_is_the_same_on_every_rank():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="rank_consistent_progress"):
        wrap_distributed(optimizer, model, progress=lambda: 0.0)
    # told so, it goes on to join the ranks, and says torch.distributed is not initialised here
    with pytest.raises(OpalctlError, match="torch.distributed initialised"):
        wrap_distributed(optimizer, model, progress=lambda: 0.0, rank_consistent_progress=True)
