"""``p2ptrain bench byzantine``: can one lying trainer (or three) spoil the model?

scikit-learn's digits (8x8 images, 10 classes; :mod:`p2ptrain.data.digits`), a small MLP, 10
workers running DiLoCo: each round every worker starts from the global model, takes H AdamW
steps on its own shard (its optimizer state persists across rounds), and sends its
pseudo-gradient; the rule aggregates, and an outer Nesterov step moves the global model. Some
workers are Byzantine and send what an attack forges (:mod:`p2ptrain.sim.attacks`).
Non-finite updates are always dropped before the rule, as every node does when it decodes an
update; statistical screening is off unless asked for, so the table shows what each rule
survives by itself.

The 10 workers are trained together as one batched model (parameters with a leading worker
axis, ``bmm``); AdamW is elementwise, so this is exactly 10 independent optimizers.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2ptrain.aggregate.cohort import Contribution, Failure
from p2ptrain.aggregate.outer import make_outer_optimizer
from p2ptrain.aggregate.rules import make_rule
from p2ptrain.aggregate.screening import Candidate, screen_cohort
from p2ptrain.core.manifests import (
    AGGREGATION_RULES,
    AggregationSpec,
    OuterOptimizerSpec,
    ScreeningSpec,
)
from p2ptrain.core.tensors import TensorSpec
from p2ptrain.data.digits import Digits, load_digits_split
from p2ptrain.errors import LocalError
from p2ptrain.sim.attacks import ATTACKS, AttackContext, attack_named
from p2ptrain.store.kernel_build import ensure_kernel

#: The rule configuration each rule runs with here: every rule is told to tolerate 3 of 10.
RULE_SETTINGS: dict[str, dict[str, str | int | float | bool]] = {
    "mean": {},
    "trimmed_mean": {"beta": 0.3},
    "median": {},
    "krum": {"f": 3},
    "centered_clip": {},
    "geometric_median": {},
}


@dataclass(frozen=True)
class ByzantineConfig:
    workers: int = 10
    rounds: int = 30
    inner_steps: int = 20
    batch: int = 32
    hidden: int = 64
    inner_lr: float = 1e-3
    outer_lr: float = 0.7
    momentum: float = 0.9
    seed: int = 0
    byzantine: tuple[int, ...] = (2, 3)
    attacks: tuple[str, ...] = tuple(a for a in ATTACKS if a != "none")
    rules: tuple[str, ...] = AGGREGATION_RULES
    default_rule: AggregationSpec = field(default_factory=AggregationSpec)


class BatchedMLP:
    """``workers`` copies of a 64-hidden-10 MLP evaluated together."""

    def __init__(self, workers: int, hidden: int) -> None:
        self.shapes = [(64, hidden), (hidden,), (hidden, 10), (10,)]
        self.params = [torch.zeros(workers, *shape, requires_grad=True) for shape in self.shapes]
        self.size = sum(math.prod(shape) for shape in self.shapes)

    def initial_vector(self, seed: int) -> torch.Tensor:
        """One model's parameters, initialised like ``nn.Linear``, as a flat vector: weight
        and bias uniform in +-1/sqrt(fan_in) of their layer."""
        generator = torch.Generator().manual_seed(seed)
        parts = []
        fan_in = 0
        for shape in self.shapes:
            if len(shape) == 2:  # a weight (in, out); its bias follows with the same fan-in
                fan_in = shape[0]
            bound = 1.0 / math.sqrt(fan_in)
            parts.append((torch.rand(shape, generator=generator) * 2 - 1).mul(bound).reshape(-1))
        return torch.cat(parts)

    def load(self, vector: torch.Tensor) -> None:
        """Set every worker's parameters to the flat ``vector``."""
        offset = 0
        with torch.no_grad():
            for param, shape in zip(self.params, self.shapes, strict=True):
                count = math.prod(shape)
                param.copy_(vector[offset : offset + count].reshape(shape).expand_as(param))
                offset += count

    def vectors(self) -> torch.Tensor:
        """(workers, size): each worker's parameters as a flat vector."""
        return torch.cat([p.detach().reshape(p.shape[0], -1) for p in self.params], dim=1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = self.params
        hidden = torch.relu(torch.bmm(x, w1) + b1.unsqueeze(1))
        return torch.bmm(hidden, w2) + b2.unsqueeze(1)


def accuracy(model: BatchedMLP, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of the single model ``vector`` (a non-finite model scores 0)."""
    if not bool(torch.isfinite(vector).all()):
        return 0.0
    single = BatchedMLP(1, model.shapes[0][1])
    single.load(vector)
    with torch.no_grad():
        predicted = single.logits(x.unsqueeze(0)).argmax(dim=-1).squeeze(0)
    return float((predicted == y).float().mean())


def update_ids(workers: int, round_index: int, seed: int) -> list[str]:
    """Ids uncorrelated with worker index, so a rule's id order favours nobody."""
    return [
        hashlib.sha256(f"{seed}/{round_index}/{worker}".encode()).hexdigest()
        for worker in range(workers)
    ]


def train_run(
    data: Digits,
    config: ByzantineConfig,
    rule_spec: AggregationSpec,
    attack_name: str,
    byzantine: int,
    *,
    screening: ScreeningSpec | None = None,
) -> float:
    """One DiLoCo run; returns the final global model's test accuracy. With ``screening``,
    updates pass :func:`screen_cohort` before the rule, as on a real node."""
    attack = attack_named(attack_name)
    workers = config.workers
    model = BatchedMLP(workers, config.hidden)
    theta = model.initial_vector(config.seed)
    rule = make_rule(rule_spec)
    outer = make_outer_optimizer(
        OuterOptimizerSpec(name="nesterov", lr=config.outer_lr, momentum=config.momentum)
    )
    outer_state: dict[str, torch.Tensor] = {}
    optimizer = torch.optim.AdamW(model.params, lr=config.inner_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed + 1)
    liars = list(range(workers - byzantine, workers))
    labels = data.train_y.clone()
    if attack.poisons_data and liars:
        labels[liars] = 9 - labels[liars]
    shard = data.train_x.shape[1]
    for round_index in range(config.rounds):
        model.load(theta)
        for _ in range(config.inner_steps):
            index = torch.randint(0, shard, (workers, config.batch), generator=generator)
            x = torch.gather(data.train_x, 1, index.unsqueeze(-1).expand(-1, -1, 64))
            y = torch.gather(labels, 1, index)
            logits = model.logits(x)
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, 10), y.reshape(-1), reduction="mean"
                )
                * workers
            )  # each worker's gradient is that of its own mean loss
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            optimizer.step()
        deltas = list(torch.sub(theta.unsqueeze(0), model.vectors()).unbind(0))
        honest = [deltas[i] for i in range(workers) if i not in liars]
        for i in liars:
            deltas[i] = attack.forge(
                AttackContext(deltas[i], honest, byzantine, workers, generator)
            ).contiguous()
        ids = update_ids(workers, round_index, config.seed)
        contributions, failures = _cohort(ids, deltas, screening)
        result = rule.aggregate(contributions, failures)
        if result.aggregate is None:
            continue  # the window fails; the network stays on theta
        stepped, outer_state = outer.step(
            {"theta": theta}, {"theta": result.aggregate}, outer_state
        )
        theta = stepped["theta"]
    return accuracy(model, theta, data.test_x, data.test_y)


def _cohort(
    ids: Sequence[str], deltas: Sequence[torch.Tensor], screening: ScreeningSpec | None
) -> tuple[list[Contribution], list[Failure]]:
    """The window's cohort: screened when asked, else only non-finite updates dropped."""
    if screening is not None:
        candidates = [Candidate(i, {"theta": d}) for i, d in zip(ids, deltas, strict=True)]
        schema = (TensorSpec(name="theta", shape=tuple(deltas[0].shape), dtype="float32"),)
        outcome = screen_cohort(candidates, schema, screening)
        return list(outcome.contributions), list(outcome.failures)
    contributions, failures = [], []
    for update_id, delta in zip(ids, deltas, strict=True):
        if bool(torch.isfinite(delta).all()):
            contributions.append(Contribution(update_id, delta))
        else:
            failures.append(Failure(update_id, "non-finite values"))
    return contributions, failures


def rule_spec(name: str) -> AggregationSpec:
    return AggregationSpec(rule=name, config=RULE_SETTINGS.get(name, {}))


def run_byzantine_benchmark(config: ByzantineConfig, progress: Any | None = None) -> dict[str, Any]:
    """The whole table: honest accuracy; every rule alone and behind the default screening,
    under every attack and Byzantine count; and the default pipeline as a node runs it
    (default screening, then the default rule with its default settings)."""
    for name in config.rules:
        if name not in AGGREGATION_RULES:
            raise LocalError(f"unknown rule {name!r}; choose from {', '.join(AGGREGATION_RULES)}")
    ensure_kernel()
    data = load_digits_split(config.workers, config.seed)
    started = time.perf_counter()
    honest = train_run(data, config, AggregationSpec(rule="mean"), "none", 0)
    screening = ScreeningSpec()
    runs = [
        (rule, attack, f, screened)
        for screened in (False, True)
        for f in (0, *config.byzantine)
        for attack in (("none",) if f == 0 else config.attacks)
        for rule in config.rules
    ]
    results: list[dict[str, Any]] = []
    for index, (rule, attack, f, screened) in enumerate(runs):
        acc = train_run(
            data, config, rule_spec(rule), attack, f, screening=screening if screened else None
        )
        row = {"rule": rule, "attack": attack, "byzantine": f, "screened": screened}
        results.append({**row, "accuracy": acc})
        if progress is not None:
            progress(index + 1, len(runs), results[-1])
    default = config.default_rule
    default_accuracy = {
        (attack, f): train_run(data, config, default, attack, f, screening=screening)
        for f in config.byzantine
        for attack in config.attacks
    }
    default_results = [
        {"attack": attack, "byzantine": f, "accuracy": acc}
        for (attack, f), acc in default_accuracy.items()
    ]
    worst = {
        f: min(acc for (_, g), acc in default_accuracy.items() if g == f) for f in config.byzantine
    }
    return {
        "honest_accuracy": honest,
        "default_rule": default.rule,
        "default_rule_config": dict(default.config) or "rule defaults",
        "default_screening": {
            "max_norm_ratio": screening.max_norm_ratio,
            "min_cosine": screening.min_cosine,
        },
        "default_rule_results": default_results,
        "default_rule_worst_drop": {str(f): honest - acc for f, acc in worst.items()},
        "results": results,
        "rule_settings": {rule: RULE_SETTINGS.get(rule, {}) for rule in config.rules},
        "config": {k: v for k, v in asdict(config).items() if k != "default_rule"},
        "wall_seconds": time.perf_counter() - started,
    }


def write_heatmap(report: dict[str, Any], path: Path, byzantine_counts: Sequence[int]) -> None:
    """A rule x attack accuracy heatmap, one panel per Byzantine count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys((r["rule"], r["screened"]) for r in report["results"]))
    columns = list(dict.fromkeys(r["attack"] for r in report["results"] if r["attack"] != "none"))
    figure, axes = plt.subplots(
        1,
        len(byzantine_counts),
        figsize=(1.5 + 5.5 * len(byzantine_counts), 6.0),
        squeeze=False,
        sharey=True,
    )
    labels = [f"{rule} + screening" if screened else rule for rule, screened in rows]
    for axis, f in zip(axes[0], byzantine_counts, strict=True):
        grid = [
            [
                next(
                    (
                        r["accuracy"]
                        for r in report["results"]
                        if (r["rule"], r["screened"]) == row
                        and r["attack"] == attack
                        and r["byzantine"] == f
                    ),
                    float("nan"),
                )
                for attack in columns
            ]
            for row in rows
        ]
        image = axis.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        axis.set_xticks(range(len(columns)), columns, rotation=35, ha="right")
        axis.set_yticks(range(len(rows)), labels)
        axis.set_title(f"{f} of {report['config']['workers']} Byzantine")
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axes[0].tolist(), label="test accuracy")
    figure.suptitle(
        f"digits MLP, 10 DiLoCo workers; honest accuracy {report['honest_accuracy']:.3f}; "
        f"default: {report['default_rule']} + screening"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
