"""The released defaults match their manifest, and a run says when it used something else."""

import json

import torch

from opalctl.opal import provenance, wrap


def test_the_manifest_matches_the_shipped_defaults():
    # fails when a prompt, a starting program or messages.py is edited without regenerating the manifest
    # (python -m opalctl.opal.provenance --write)
    assert provenance.differences() == {}
    assert set(provenance.expected()) == set(provenance.FILES)


def test_a_run_records_the_defaults_it_used(tmp_path):
    model = torch.nn.Linear(3, 1)
    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, backend="keep", total_steps=10,
                     run_dir=tmp_path / "opal")
    optimizer.close()
    start = json.loads((tmp_path / "opal" / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start"
    assert start["defaults_sha256"] == provenance.current()
    assert start["defaults_differ"] == {}


def test_a_run_with_other_programs_says_so(tmp_path, capsys):
    from opalctl.opal.optimizer import AgentOptimizer, AgentSettings, default_sources

    sources = default_sources()
    sources["updater.py"] = sources["updater.py"].replace("LR_SCALE = 1.0", "LR_SCALE = 0.5")
    model = torch.nn.Linear(3, 1)
    optimizer = AgentOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               AgentSettings(total_steps=10, backend="keep", decisions=1, run_dir=tmp_path / "opal",
                                             sources=sources))
    optimizer.close()
    start = json.loads((tmp_path / "opal" / "events.jsonl").read_text().splitlines()[0])
    assert start["defaults_differ"]
    assert "differ from the released ones" in capsys.readouterr().err
