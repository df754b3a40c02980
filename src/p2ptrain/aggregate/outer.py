"""Outer optimizers: the step from the aggregate pseudo-gradient to the next canonical
weights (DESIGN §4, step 5), bit-exact like the rules.

The pseudo-gradient is ``g = theta_base - theta_local`` averaged by the aggregation rule,
so a step *subtracts* it. Every step is a few elementwise float32 operations, each its own
call (never ``addcmul``/``add(alpha=)``/``lerp``, which may fuse multiply and add), streamed
chunk by chunk through cache-sized scratch: the same bytes on every machine. ``lr`` and
``momentum`` are rounded to float32 once (``0.7`` is ``0.699999988...``).

Optimizer state is a dict of float32 tensors (``momentum.<param>`` for Nesterov, nothing
for SGD) that round-trips through :func:`p2ptrain.core.tensors.encode_state_dict` as a
blob; an empty state means zeros. Inputs are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

import torch

from p2ptrain.aggregate import native
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.core.manifests import OuterOptimizerSpec
from p2ptrain.errors import LocalError

__all__ = [
    "MOMENTUM_PREFIX",
    "OuterNesterov",
    "OuterOptimizer",
    "OuterSGD",
    "OuterStep",
    "make_outer_optimizer",
]

#: State key of a parameter's momentum buffer: ``momentum.<parameter name>``.
MOMENTUM_PREFIX = "momentum."

Tensors = Mapping[str, torch.Tensor]


class OuterStep(NamedTuple):
    """The new weights and the new optimizer state (fresh tensors); unpacks as
    ``params, state = optimizer.step(...)``."""

    params: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]


class OuterOptimizer(Protocol):
    """Applies an aggregate pseudo-gradient to the canonical weights."""

    name: str

    def step(
        self, params: Tensors, pseudo_gradient: Tensors, state: Tensors | None = None
    ) -> OuterStep: ...

    def state_names(self, params: Iterable[str]) -> dict[str, str]:
        """The state entries a step writes: state name -> the parameter it belongs to."""
        ...

    def step_into(
        self,
        params: Tensors,
        pseudo_gradient: Tensors,
        state: Tensors | None,
        *,
        new_params: Tensors,
        new_state: Tensors,
    ) -> None:
        """:meth:`step`, writing into the given tensors (shaped like the parameters; for
        the state, named by :meth:`state_names`), which share no memory with the inputs."""
        ...


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _check_lr(lr: float) -> None:
    if isinstance(lr, bool) or not (math.isfinite(lr) and 0.0 <= lr <= 10.0):
        raise LocalError(f"outer_optimizer.lr must be a number in [0, 10], got {lr!r}")


def _check_momentum(momentum: float) -> None:
    if isinstance(momentum, bool) or not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
        raise LocalError(f"outer_optimizer.momentum must be a number in [0, 1), got {momentum!r}")


def _check_tensors(params: Tensors, pseudo_gradient: Tensors) -> None:
    """Same names, float32, same shapes; messages name the first mismatch."""
    if set(params) != set(pseudo_gradient):
        missing = sorted(set(params) - set(pseudo_gradient))
        extra = sorted(set(pseudo_gradient) - set(params))
        raise LocalError(
            "the pseudo-gradient must name the same tensors as the weights; "
            f"missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name in sorted(params):
        for what, tensor in (("weight", params[name]), ("pseudo-gradient", pseudo_gradient[name])):
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
                raise LocalError(
                    f"{what} {name!r} is {tensor.dtype} on {tensor.device}; canonical outer "
                    "steps take float32 CPU tensors (use .float().cpu())"
                )
        if params[name].shape != pseudo_gradient[name].shape:
            raise LocalError(
                f"pseudo-gradient {name!r} has shape {tuple(pseudo_gradient[name].shape)}, "
                f"the weight has {tuple(params[name].shape)}"
            )


def _momentum(params: Tensors, state: Tensors | None) -> dict[str, torch.Tensor | None]:
    """Each parameter's momentum buffer from ``state`` (None: zeros, for an empty state)."""
    if not state:
        return dict.fromkeys(params)
    expected = {MOMENTUM_PREFIX + name for name in params}
    if set(state) != expected:
        unknown = sorted(set(state) - expected)
        missing = sorted(expected - set(state))
        raise LocalError(
            "the outer optimizer state does not match the weights: "
            f"missing {missing[:3]}, unexpected {unknown[:3]}; pass the state saved with "
            "these weights, or an empty one to start from zero momentum"
        )
    buffers: dict[str, torch.Tensor | None] = {}
    for name in params:
        buffer = state[MOMENTUM_PREFIX + name]
        if (
            buffer.dtype != torch.float32
            or buffer.shape != params[name].shape
            or buffer.device.type != "cpu"
        ):
            raise LocalError(
                f"momentum buffer {name!r} is {buffer.dtype} {tuple(buffer.shape)} on "
                f"{buffer.device}; the weight is float32 {tuple(params[name].shape)} on the CPU"
            )
        buffers[name] = buffer
    return buffers


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


class OuterSGD:
    """``theta <- theta - lr * g`` (multiply, then subtract). FedAvg is ``lr = 1``, which
    applies the aggregate exactly: ``theta - g``."""

    name = "sgd"

    def __init__(self, lr: float = 1.0) -> None:
        _check_lr(lr)
        self.lr = lr
        self._lr32 = _float32(lr)

    def state_names(self, params: Iterable[str]) -> dict[str, str]:
        return {}

    def step(
        self, params: Tensors, pseudo_gradient: Tensors, state: Tensors | None = None
    ) -> OuterStep:
        """New weights; SGD keeps no state, so ``state`` must be empty."""
        new_params = {name: torch.empty(theta.shape) for name, theta in params.items()}
        self.step_into(params, pseudo_gradient, state, new_params=new_params, new_state={})
        return OuterStep(new_params, {})

    def step_into(
        self,
        params: Tensors,
        pseudo_gradient: Tensors,
        state: Tensors | None,
        *,
        new_params: Tensors,
        new_state: Tensors,
    ) -> None:
        _check_tensors(params, pseudo_gradient)
        if state:
            raise LocalError("outer SGD keeps no state; pass an empty state")
        scratch = torch.empty(CHUNK, dtype=torch.float32)
        for name, theta in params.items():
            theta_flat, g_flat = _flat(theta), _flat(pseudo_gradient[name])
            new_flat = _flat(new_params[name])
            for start in range(0, new_flat.numel(), CHUNK):
                end = min(start + CHUNK, new_flat.numel())
                step = scratch[: end - start]
                torch.mul(g_flat[start:end], self._lr32, out=step)
                torch.sub(theta_flat[start:end], step, out=new_flat[start:end])


class OuterNesterov:
    """Nesterov momentum, as ``torch.optim.SGD(nesterov=True)`` without dampening or weight
    decay (DiLoCo's outer optimizer): ``buf <- mu buf + g``; ``step = g + mu buf``;
    ``theta <- theta - lr step``. Defaults are DiLoCo's: ``lr = 0.7``, ``mu = 0.9``."""

    name = "nesterov"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        _check_lr(lr)
        _check_momentum(momentum)
        self.lr, self.momentum = lr, momentum
        self._lr32, self._mu32 = _float32(lr), _float32(momentum)

    def state_names(self, params: Iterable[str]) -> dict[str, str]:
        return {MOMENTUM_PREFIX + name: name for name in params}

    def step(
        self, params: Tensors, pseudo_gradient: Tensors, state: Tensors | None = None
    ) -> OuterStep:
        """New weights and momentum buffers (``state`` empty or None: zero momentum)."""
        new_params = {name: torch.empty(theta.shape) for name, theta in params.items()}
        new_state = {
            key: torch.empty(params[name].shape) for key, name in self.state_names(params).items()
        }
        self.step_into(params, pseudo_gradient, state, new_params=new_params, new_state=new_state)
        return OuterStep(new_params, new_state)

    def step_into(
        self,
        params: Tensors,
        pseudo_gradient: Tensors,
        state: Tensors | None,
        *,
        new_params: Tensors,
        new_state: Tensors,
    ) -> None:
        _check_tensors(params, pseudo_gradient)
        momentum = _momentum(params, state)
        scratch = torch.empty(CHUNK, dtype=torch.float32)
        for name, theta in params.items():
            old = momentum[name]
            self._stream(
                _flat(theta),
                _flat(pseudo_gradient[name]),
                None if old is None else _flat(old),
                new_theta=_flat(new_params[name]),
                new_buffer=_flat(new_state[MOMENTUM_PREFIX + name]),
                scratch=scratch,
            )

    def _stream(
        self,
        theta: torch.Tensor,
        g: torch.Tensor,
        buffer: torch.Tensor | None,
        *,
        new_theta: torch.Tensor,
        new_buffer: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        if native.nesterov(
            theta, g, buffer, mu=self._mu32, lr=self._lr32, new_theta=new_theta, new_buf=new_buffer
        ):
            return  # the same operations in C, one pass
        for start in range(0, theta.numel(), CHUNK):
            end = min(start + CHUNK, theta.numel())
            buf, step = new_buffer[start:end], scratch[: end - start]
            if buffer is None:
                buf.zero_()
            else:
                torch.mul(buffer[start:end], self._mu32, out=buf)
            torch.add(buf, g[start:end], out=buf)  # buf = mu * buf + g
            torch.mul(buf, self._mu32, out=step)
            torch.add(g[start:end], step, out=step)  # step = g + mu * buf
            torch.mul(step, self._lr32, out=step)
            torch.sub(theta[start:end], step, out=new_theta[start:end])


def make_outer_optimizer(spec: OuterOptimizerSpec) -> OuterOptimizer:
    """The outer optimizer a manifest names (``sgd`` or ``nesterov``)."""
    if spec.name == "sgd":
        if spec.momentum != 0.0:
            raise LocalError("outer_optimizer.momentum must be 0 for 'sgd'; use 'nesterov'")
        return OuterSGD(spec.lr)
    if spec.name == "nesterov":
        return OuterNesterov(spec.lr, spec.momentum)
    raise LocalError(f"outer_optimizer.name {spec.name!r} is unknown; use 'sgd' or 'nesterov'")
