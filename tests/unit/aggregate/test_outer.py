"""Outer optimizers: hand-computed steps, agreement with torch.optim.SGD, exact FedAvg,
state that round-trips through safetensors, and clear errors for mismatched inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from p2ptrain.aggregate import native
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.aggregate.outer import (
    MOMENTUM_PREFIX,
    OuterNesterov,
    OuterSGD,
    make_outer_optimizer,
)
from p2ptrain.core.manifests import OuterOptimizerSpec
from p2ptrain.core.tensors import decode_state_dict, encode_state_dict
from p2ptrain.errors import LocalError

SEED = 4_242


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def random_model(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(CHUNK + 33, generator=generator).reshape(-1, 7),
        "head.weight": torch.randn(13, 5, generator=generator),
        "head.bias": torch.randn(5, generator=generator),
        "scale": torch.randn((), generator=generator),
    }


def test_two_nesterov_steps_by_hand() -> None:
    # lr = mu = 0.5 (exact in binary). Step 1: buf = g1 = (1, -2); step = g1 + buf / 2 =
    # (1.5, -3); theta = (1, 2) - step / 2 = (0.25, 3.5). Step 2: buf = (0.5, -1) + (2, 0)
    # = (2.5, -1); step = (2, 0) + (1.25, -0.5) = (3.25, -0.5); theta = (-1.375, 3.75).
    optimizer = OuterNesterov(lr=0.5, momentum=0.5)
    first = optimizer.step({"w": t(1, 2)}, {"w": t(1, -2)})
    assert first.params["w"].tolist() == [0.25, 3.5]
    assert first.state == {"momentum.w": first.state["momentum.w"]}
    assert first.state["momentum.w"].tolist() == [1.0, -2.0]
    params, state = optimizer.step(first.params, {"w": t(2, 0)}, first.state)
    assert params["w"].tolist() == [-1.375, 3.75]
    assert state["momentum.w"].tolist() == [2.5, -1.0]


def test_nesterov_matches_torch_sgd_with_nesterov_momentum() -> None:
    params = random_model(SEED)
    generator = torch.Generator().manual_seed(SEED + 1)
    gradients = [
        {name: torch.randn(p.shape, generator=generator) for name, p in params.items()}
        for _ in range(4)
    ]
    ours = OuterNesterov(lr=0.7, momentum=0.9)
    current, state = params, {}
    for gradient in gradients:
        current, state = ours.step(current, gradient, state)
    theirs = {name: torch.nn.Parameter(p.clone()) for name, p in params.items()}
    sgd = torch.optim.SGD(theirs.values(), lr=0.7, momentum=0.9, nesterov=True)
    for gradient in gradients:
        for name, parameter in theirs.items():
            parameter.grad = gradient[name].clone()
        sgd.step()
    for name, parameter in theirs.items():
        assert torch.allclose(current[name], parameter.detach(), rtol=1e-5, atol=1e-5), (
            f"seed={SEED} {name}"
        )
        buffer = sgd.state[parameter]["momentum_buffer"]
        assert torch.allclose(state[MOMENTUM_PREFIX + name], buffer, rtol=1e-5, atol=1e-5)


def test_sgd_with_lr_one_applies_the_aggregate_exactly() -> None:
    params = random_model(SEED)
    gradient = random_model(SEED + 2)
    new, state = OuterSGD(1.0).step(params, gradient)
    assert state == {}
    for name in params:
        expected = (params[name] - gradient[name]).numpy().tobytes()
        assert new[name].numpy().tobytes() == expected, f"seed={SEED} {name}"


def test_sgd_multiplies_by_the_float32_learning_rate_then_subtracts() -> None:
    params, gradient = random_model(SEED), random_model(SEED + 3)
    new, _ = OuterSGD(0.7).step(params, gradient)
    lr = torch.tensor(0.7, dtype=torch.float32)
    for name in params:
        assert torch.equal(new[name], params[name] - gradient[name] * lr), f"seed={SEED}"


def test_nesterov_without_momentum_is_sgd() -> None:
    params, gradient = random_model(SEED), random_model(SEED + 4)
    plain, _ = OuterSGD(0.7).step(params, gradient)
    nesterov, _ = OuterNesterov(lr=0.7, momentum=0.0).step(params, gradient)
    for name in params:
        assert torch.equal(plain[name], nesterov[name]), f"seed={SEED} {name}"


def test_state_round_trips_through_safetensors_bytes() -> None:
    params = random_model(SEED)
    gradients = [random_model(SEED + 5), random_model(SEED + 6)]
    optimizer = OuterNesterov()
    first_params, first_state = optimizer.step(params, gradients[0])
    blob = encode_state_dict(first_state)
    restored = decode_state_dict(bytes(blob))
    assert sorted(restored) == sorted(MOMENTUM_PREFIX + name for name in params)
    direct = optimizer.step(first_params, gradients[1], first_state)
    via_blob = optimizer.step(first_params, gradients[1], restored)
    for name in params:
        assert torch.equal(direct.params[name], via_blob.params[name]), f"seed={SEED}"
    assert encode_state_dict(direct.state) == encode_state_dict(via_blob.state)


def test_an_empty_state_is_zero_momentum() -> None:
    params, gradient = random_model(SEED), random_model(SEED + 7)
    zeros = {MOMENTUM_PREFIX + name: torch.zeros_like(p) for name, p in params.items()}
    optimizer = OuterNesterov()
    for state in (None, {}):
        a, _ = optimizer.step(params, gradient, state)
        b, _ = optimizer.step(params, gradient, zeros)
        assert all(torch.equal(a[name], b[name]) for name in params)


def test_inputs_are_not_modified() -> None:
    params, gradient = random_model(SEED), random_model(SEED + 8)
    state = OuterNesterov().step(params, gradient).state
    copies = [{k: v.clone() for k, v in d.items()} for d in (params, gradient, state)]
    OuterNesterov().step(params, gradient, state)
    OuterSGD(0.5).step(params, gradient)
    for original, copy in zip((params, gradient, state), copies, strict=True):
        assert all(torch.equal(original[k], copy[k]) for k in original)


def test_non_contiguous_inputs_give_the_same_bits() -> None:
    base = torch.randn(8, 6, generator=torch.Generator().manual_seed(SEED))
    params, gradient = {"w": base.t()}, {"w": (base * 0.5).t()}
    contiguous = {"w": base.t().contiguous()}, {"w": (base * 0.5).t().contiguous()}
    a, _ = OuterNesterov().step(params, gradient)
    b, _ = OuterNesterov().step(*contiguous)
    assert a["w"].shape == (6, 8) and torch.equal(a["w"], b["w"])


def test_make_outer_optimizer_follows_the_manifest() -> None:
    nesterov = make_outer_optimizer(OuterOptimizerSpec())
    assert isinstance(nesterov, OuterNesterov)
    assert (nesterov.lr, nesterov.momentum) == (0.7, 0.9)
    sgd = make_outer_optimizer(OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0))
    assert isinstance(sgd, OuterSGD) and sgd.lr == 1.0


@pytest.mark.parametrize(
    ("params", "gradient", "state", "message"),
    [
        ({"w": t(1)}, {"v": t(1)}, None, "same tensors as the weights"),
        ({"w": t(1, 2)}, {"w": t(1)}, None, "has shape"),
        ({"w": t(1)}, {"w": torch.ones(1, dtype=torch.float64)}, None, "float64"),
        ({"w": t(1)}, {"w": t(1)}, {"momentum.v": t(0)}, "does not match the weights"),
        ({"w": t(1)}, {"w": t(1)}, {"momentum.w": t(0, 0)}, "momentum buffer 'w'"),
    ],
)
def test_mismatched_inputs_are_refused(
    params: dict[str, torch.Tensor],
    gradient: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor] | None,
    message: str,
) -> None:
    with pytest.raises(LocalError, match=message):
        OuterNesterov().step(params, gradient, state)


def test_sgd_refuses_a_momentum_state() -> None:
    with pytest.raises(LocalError, match="keeps no state"):
        OuterSGD().step({"w": t(1)}, {"w": t(1)}, {"momentum.w": t(0)})


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: OuterSGD(-1.0), "lr"),
        (lambda: OuterSGD(float("nan")), "lr"),
        (lambda: OuterNesterov(lr=11.0), "lr"),
        (lambda: OuterNesterov(momentum=1.0), "momentum"),
    ],
)
def test_bad_settings_name_their_key(build: Callable[[], object], key: str) -> None:
    with pytest.raises(LocalError, match=rf"outer_optimizer\.{key} must be"):
        build()


def test_the_kernel_and_torch_take_the_same_nesterov_step() -> None:
    """The C step (one pass, threaded) and torch's six operations: the same bits, with and
    without momentum, on -0.0, zeros, subnormals and large values."""
    if not native.available():
        pytest.skip("no C compiler: the kernel is not built here")
    params = random_model(SEED)
    generator = torch.Generator().manual_seed(SEED + 2)
    gradient = {name: torch.randn(p.shape, generator=generator) for name, p in params.items()}
    special = torch.tensor([-0.0, 0.0, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0])
    gradient["embed.weight"].view(-1)[: special.numel()] = special
    params["embed.weight"].view(-1)[: special.numel()] = special.flip(0)
    optimizer = OuterNesterov(lr=0.7, momentum=0.9)
    loader = native.installed_loader()
    try:
        stepped = {"kernel": optimizer.step(params, gradient)}
        again = {
            "kernel": optimizer.step(stepped["kernel"].params, gradient, stepped["kernel"].state)
        }
        native.install_kernel(None)
        stepped["torch"] = optimizer.step(params, gradient)
        again["torch"] = optimizer.step(stepped["torch"].params, gradient, stepped["torch"].state)
    finally:
        native.install_kernel(loader)
    for name in params:
        for outcome in (stepped, again):
            kernel, torch_step = outcome["kernel"], outcome["torch"]
            assert torch.equal(
                kernel.params[name].view(torch.int32), torch_step.params[name].view(torch.int32)
            ), f"seed {SEED}: {name}"
            key = MOMENTUM_PREFIX + name
            assert torch.equal(
                kernel.state[key].view(torch.int32), torch_step.state[key].view(torch.int32)
            ), f"seed {SEED}: {key}"
