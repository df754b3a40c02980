"""``bench convergence --sparse``: the experiment our network runs holds SparseLoCo's recipe,
and the dense default is the demo's."""

from __future__ import annotations

import pytest

from p2ptrain.bench.convergence_network import DENSE_RECIPE, sparse_recipe
from p2ptrain.core.experiment_config import parse_experiment_toml
from p2ptrain.core.manifests import AggregationSpec, CodecSpec, OuterOptimizerSpec
from p2ptrain.node.local_network import experiment_toml
from p2ptrain.torch.demo_settings import DEMO_AGGREGATE_PRECISION, DEMO_CODEC


def tables(recipe: dict[str, object]) -> dict[str, dict[str, object]]:
    text = experiment_toml(
        validators=["ab" * 32],
        reducers=[],
        quorum=1,
        workload={"name": "char-gpt", "config": {}},
        inner_steps=25,
        deadline_s=30.0,
        proposal_s=5.0,
        min_updates=2,
        max_updates=4,
        **recipe,  # type: ignore[arg-type]
    )
    return dict(parse_experiment_toml(text))


@pytest.mark.parametrize(("inner_steps", "warm_up"), [(25, 4), (50, 2), (20, 5), (400, 1)])
def test_the_sparse_recipe_is_written_into_the_experiment(inner_steps: int, warm_up: int) -> None:
    parsed = tables(sparse_recipe(0.02, inner_steps))
    codec = CodecSpec(**parsed["codec"])  # type: ignore[arg-type]
    assert codec == CodecSpec(
        name="sparseloco", config={"fraction": 0.02, "dense_windows": warm_up}
    )
    aggregation = AggregationSpec(**parsed["aggregation"])  # type: ignore[arg-type]
    assert (aggregation.rule, aggregation.precision) == ("contributor_mean", "int4")
    outer = OuterOptimizerSpec(**parsed["outer_optimizer"])  # type: ignore[arg-type]
    assert outer == OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0)


def test_the_dense_default_is_the_demos() -> None:
    parsed = tables(DENSE_RECIPE)
    assert parsed["codec"] == {"name": DEMO_CODEC}
    assert parsed["aggregation"] == {"precision": DEMO_AGGREGATE_PRECISION}
    assert parsed["outer_optimizer"]["name"] == "nesterov"


@pytest.mark.parametrize("fraction", [-0.1, 0.6])
def test_the_command_refuses_a_fraction_outside_0_to_one_half(fraction: float) -> None:
    from p2ptrain.cli.main import main

    assert main(["bench", "convergence", "--sparse", str(fraction), "--no-netns"]) == 2


def parsed_task(*argv: str) -> tuple[int, int, float]:
    import argparse

    from p2ptrain.cli.bench_commands import _add_convergence, _task_defaults

    parser = argparse.ArgumentParser()
    _add_convergence(parser.add_subparsers())
    args = parser.parse_args(["convergence", *argv])
    _task_defaults(args)
    return args.windows, args.inner_steps, args.sparse


def test_a_run_to_target_defaults_to_the_long_task_and_the_sparse_recipe() -> None:
    from p2ptrain.cli.bench_commands import TO_TARGET
    from p2ptrain.torch.demo_settings import DEMO_DEFAULTS

    demo = (int(DEMO_DEFAULTS["windows"]), int(DEMO_DEFAULTS["inner_steps"]), 0.0)
    assert parsed_task() == demo
    assert parsed_task("--until-target") == (
        TO_TARGET["windows"],
        TO_TARGET["inner_steps"],
        TO_TARGET["sparse"],
    )
    # what the command line says wins, one option at a time
    assert parsed_task("--until-target", "--sparse", "0") == (
        TO_TARGET["windows"],
        TO_TARGET["inner_steps"],
        0.0,
    )
    assert parsed_task("--windows", "96", "--inner-steps", "25") == (96, 25, 0.0)


@pytest.mark.parametrize(("inner_steps", "every"), [(20, 20), (25, 25), (50, 25), (5, 5)])
def test_ddp_snapshots_at_most_every_25_steps(inner_steps: int, every: int) -> None:
    """DDP's time to the target is its first snapshot below it: a window of 50 steps must not
    round it up by 50 while our network is read at every head."""
    from p2ptrain.bench.convergence_task import Task

    assert Task(inner_steps=inner_steps).snapshot_steps == every
