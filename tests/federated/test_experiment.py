"""Configs and the ``lowrank-jax federate`` command."""

import json
import pathlib

import pytest
import yaml

from lowrank_jax import cli
from lowrank_jax.federated import experiment, strategies

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["fed_hera", "fed_tree"])
def test_shipped_configs_build_their_strategies(name):
    config = experiment.load_experiment(str(CONFIGS / f"{name}.yaml"))
    assert config.seeds == [0, 1, 2]
    built = [experiment.build_strategy(s) for s in config.strategies]
    assert len(built) == 5
    if name == "fed_hera":
        assert built[0] == strategies.FedHera()
        assert built[1] == strategies.FedHera(unbiased=False)
        assert built[2] == strategies.FlexLoRA()
    else:
        assert built[0] == strategies.FedTreeLoRA(warmup_rounds=3, tau=0.5, rebuild_every=5)
        assert built[1].flat_groups == 4


def test_bad_configs_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"strategies": [{"name": "fedprox"}]}))
    with pytest.raises(ValueError, match="fedprox"):
        experiment.load_experiment(str(bad))
    bad.write_text(yaml.safe_dump({"round": 3}))
    with pytest.raises(ValueError, match="unknown keys"):
        experiment.load_experiment(str(bad))
    bad.write_text(yaml.safe_dump({"schedule": {"epochs": 3}}))
    with pytest.raises(ValueError, match="schedule: unknown keys"):
        experiment.load_experiment(str(bad))
    with pytest.raises(ValueError, match="bad options"):
        experiment.build_strategy({"name": "fedhera", "rank": 3})


def test_federate_command_end_to_end(tmp_path, capsys, saved_figures):
    config = {
        "name": "tiny", "run_dir": str(tmp_path / "run"), "checkpoint": True,
        "task": {"clients": 4, "train_per_client": 16, "test_per_client": 8, "features": 16},
        "model": {"hidden": 8, "depth": 2, "rank": 4},
        "schedule": {"rounds": 2, "local_steps": 2, "batch_size": 4, "participation": 0.5},
        "seeds": [0],
        "strategies": [{"name": "fedhera"}, {"name": "fedtree", "warmup_rounds": 1}],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["federate", "--config", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| fedhera |" in out and "| fedtree |" in out
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert len(saved["histories"]["fedhera"][0]) == 2
    # the plot: per strategy, the mean (here one seed) global / personal accuracy per round
    plot = saved_figures.pop(str(tmp_path / "run" / "accuracy.png"))
    assert plot.ink() > 0.02 and [ax.get_title() for ax in plot.figure.axes] == [
        "global accuracy", "personal accuracy"]
    want = [(name, [1.0, 2.0], [row[key] for row in saved["histories"][name][0]])
            for key in ("global_accuracy", "personal_accuracy") for name in ("fedhera", "fedtree")]
    got = plot.lines()
    assert [(label, x) for label, x, _ in got] == [(label, x) for label, x, _ in want]
    for (label, _, y), (_, _, y_want) in zip(got, want):
        assert y == pytest.approx(y_want), label
    assert (tmp_path / "run" / "checkpoints" / "fedhera" / "seed0").is_dir()
    # a re-run resumes from the checkpoints: same numbers, nothing retrained
    assert cli.main(["federate", "--config", str(path), "--no-progress"]) == 0
    again = json.loads((tmp_path / "run" / "results.json").read_text())
    assert again["histories"] == saved["histories"]
    assert cli.main(["federate", "--config", str(tmp_path / "missing.yaml")]) == 2
