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


def test_the_sparse_recipe_is_written_into_the_experiment() -> None:
    parsed = tables(sparse_recipe(0.02))
    codec = CodecSpec(**parsed["codec"])  # type: ignore[arg-type]
    assert codec == CodecSpec(name="sparseloco", config={"fraction": 0.02, "dense_windows": 4})
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
