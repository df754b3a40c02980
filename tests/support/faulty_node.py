"""``python -m tests.support.faulty_node ARGS``: ``p2ptrain ARGS`` with a fault injected.

The fault is named by the environment variable ``P2PTRAIN_TEST_FAULT`` (the role-failure
tests set it for one node; fault injection by role and step, after torchft's tests):

* ``train:N`` -- the workload's N-th ``train_window`` call raises ``RuntimeError``;
* ``train:always`` -- every call does;
* ``tick:once`` -- a validator's or reducer's first tick raises ``RuntimeError``;
* ``update:scale:K`` -- every window's trained weights are moved K times as far from the
  window's base as training moved them, so the trainer's pseudo-gradient is K times its
  honest norm (screening rejects it as an outlier once the cohort has honest updates).

Everything else is the real node: the real CLI, network, protocol and workload.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

FAULT_ENV = "P2PTRAIN_TEST_FAULT"


def _faulty_training(when: str) -> None:
    from p2ptrain.torch import registry
    from p2ptrain.torch.char_gpt import char_gpt_workload

    def factory(config: Mapping[str, Any]) -> Any:
        workload = char_gpt_workload(config)
        train_window = workload.train_window
        calls = [0]

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if when == "always" or calls[0] == int(when):
                raise RuntimeError(f"injected fault in training call {calls[0]}")
            return train_window(*args, **kwargs)

        workload.train_window = failing  # type: ignore[method-assign]
        return workload

    registry.register("char-gpt", factory, replace=True)


def _scaled_updates(scale: float) -> None:
    from p2ptrain.torch import registry
    from p2ptrain.torch.char_gpt import char_gpt_workload

    def factory(config: Mapping[str, Any]) -> Any:
        workload = char_gpt_workload(config)
        train_window = workload.train_window

        def scaled(weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
            result = train_window(weights, *args, **kwargs)
            moved = {
                name: weights[name] + scale * (trained - weights[name])
                for name, trained in result.weights.items()
            }
            return result._replace(weights=moved)

        workload.train_window = scaled  # type: ignore[method-assign]
        return workload

    registry.register("char-gpt", factory, replace=True)


def _faulty_tick() -> None:
    from p2ptrain.protocol.participant import Participant

    tick = Participant.tick
    raised = [False]

    def failing(self: Participant, now: float) -> Any:
        if not raised[0]:
            raised[0] = True
            raise RuntimeError("injected fault in the first tick")
        return tick(self, now)

    Participant.tick = failing  # type: ignore[method-assign]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main() -> int:
    fault = os.environ.get(FAULT_ENV, "")
    kind, _, when = fault.partition(":")
    how, _, factor = when.partition(":")
    if kind == "train":
        _faulty_training(when)
    elif kind == "tick" and when == "once":
        _faulty_tick()
    elif kind == "update" and how == "scale" and _is_number(factor):
        _scaled_updates(float(factor))
    else:
        print(f"faulty_node: unknown {FAULT_ENV}={fault!r}", file=sys.stderr)
        return 2
    from p2ptrain.cli.main import main as p2ptrain_main

    return p2ptrain_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
