"""How fast each aggregation rule runs, compared with copying the same bytes.

A reducer aggregates a window's updates once per window, so a rule is fast enough when it
costs a small multiple of merely touching those updates. The baseline is a memcpy of every
update into a preallocated destination (``dst.copy_(src)`` per update, torch's own threaded
copy): the least any rule must do is read every input once.

Each rule (every rule in the registry, default settings) writes its aggregate into one
preallocated output buffer, as a reducer does from window to window, so neither side pays
for faulting in fresh memory. Each repeat times the memcpy right before every rule
(interleaved, so drift on a shared machine hits both alike); each rule's ratio is its best
time over the best of the memcpy timings taken right before it, the same number of samples
on each side, and the first repeat also warms each rule's scratch buffers. Data is seeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from p2ptrain.aggregate.cohort import Contribution
from p2ptrain.aggregate.rules import make_rule, rule_names
from p2ptrain.core.manifests import AggregationSpec
from p2ptrain.errors import LocalError
from p2ptrain.store.kernel_build import ensure_kernel

__all__ = ["make_updates", "measure_rules"]


def make_updates(n_updates: int, values: int, seed: int = 0) -> list[Contribution]:
    """``n_updates`` seeded float32 pseudo-gradients of ``values`` values each: a shared
    direction plus per-update noise, like honest updates of one window."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(values, generator=generator)
    updates = []
    for index in range(n_updates):
        vector = torch.randn(values, generator=generator)
        vector.mul_(0.5).add_(common)
        updates.append(Contribution(f"{index:064x}", vector, weight=1.0))
    return updates


def _seconds(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure_rules(
    n_updates: int = 8, values: int = 25_000_000, repeats: int = 3, seed: int = 0
) -> dict[str, object]:
    """Time every registered rule on ``n_updates`` seeded updates of ``values`` float32
    values each, against a memcpy of the same bytes (best of ``repeats``).

    Returns ``{"memcpy_seconds": s, "rules": {name: {"seconds": s, "ratio_to_memcpy": r}}}``.
    Needs memory for about ``2 * n_updates + 3`` vectors of ``values`` float32 values.
    """
    if n_updates < 1 or values < 1 or repeats < 1:
        raise LocalError(
            f"n_updates={n_updates}, values={values}, repeats={repeats}: each must be >= 1"
        )
    ensure_kernel()
    updates = make_updates(n_updates, values, seed)
    sources = [update.vector for update in updates if isinstance(update.vector, torch.Tensor)]
    destinations = [torch.zeros_like(source) for source in sources]
    out = torch.zeros(values, dtype=torch.float32)
    rules = {name: make_rule(AggregationSpec(rule=name)) for name in rule_names()}

    def memcpy() -> None:
        for source, destination in zip(sources, destinations, strict=True):
            destination.copy_(source)

    memcpy_best = dict.fromkeys(rules, float("inf"))
    best = dict.fromkeys(rules, float("inf"))
    for _ in range(repeats):
        for name, rule in rules.items():
            memcpy_best[name] = min(memcpy_best[name], _seconds(memcpy))
            start = time.perf_counter()
            rule.aggregate(updates, out=out)
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "memcpy_seconds": min(memcpy_best.values()),
        "rules": {
            name: {
                "seconds": seconds,
                "memcpy_seconds": memcpy_best[name],
                "ratio_to_memcpy": seconds / memcpy_best[name],
            }
            for name, seconds in best.items()
        },
    }
