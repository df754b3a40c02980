"""The bit-exact reductions and the flat-vector layout they work on."""

from __future__ import annotations

import math

import torch

from p2ptrain.aggregate.exact import (
    CHUNK,
    all_finite,
    dot64,
    flatten,
    norm64,
    sqdist64,
    sqnorm64,
    unflatten,
)

SEED = 11


def vectors(length: int = 3 * CHUNK + 17) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randn(length, generator=generator), torch.randn(length, generator=generator)


def test_flatten_and_unflatten_are_inverse_in_sorted_name_order() -> None:
    tensors = {"b": torch.arange(3.0), "a": torch.arange(6.0).reshape(2, 3)}
    flat = flatten(tensors)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]  # "a" first
    back = unflatten(flat, tensors)
    assert all(torch.equal(back[name], tensors[name]) for name in tensors)


def test_reductions_match_float64_and_hand_values() -> None:
    a = torch.tensor([3.0, 4.0])
    assert sqnorm64(a) == 25.0 and norm64(a) == 5.0
    assert dot64(a, torch.tensor([2.0, -1.0])) == 2.0
    assert sqdist64(a, torch.tensor([0.0, 0.0])) == 25.0
    x, y = vectors()
    # the definition: float32 differences, squared exactly and summed in float64
    reference = float(((x - y).double() ** 2).sum())
    assert abs(sqdist64(x, y) - reference) <= 1e-12 * reference, f"seed={SEED}"
    wide = float(((x.double() - y.double()) ** 2).sum())
    assert abs(sqdist64(x, y) - wide) <= 1e-6 * wide, f"seed={SEED}"


def test_reductions_do_not_depend_on_thread_count() -> None:
    x, y = vectors()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (sqnorm64(x), dot64(x, y), sqdist64(x, y))
        torch.set_num_threads(2)
        two = (sqnorm64(x), dot64(x, y), sqdist64(x, y))
    finally:
        torch.set_num_threads(before)
    assert one == two, f"seed={SEED}"
    assert sqdist64(x, y) == sqdist64(y, x)


def test_all_finite_is_exactly_isfinite_all_even_where_the_sum_overflows() -> None:
    generator = torch.Generator().manual_seed(11)
    values = torch.randn(3 * 65536 + 5, generator=generator)
    cases = {"plain": values.clone(), "empty": torch.empty(0)}
    for name, poison in (("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):
        poisoned = values.clone()
        poisoned[70000] = poison
        cases[name] = poisoned
    both = values.clone()
    both[3], both[9] = math.inf, -math.inf  # they add to NaN, not to a finite value
    cases["inf and -inf"] = both
    huge = torch.full((1000,), 3.0e38)  # finite values whose float32 sum overflows
    cases["overflowing sum"] = huge
    for name, tensor in cases.items():
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all()), name
    assert all_finite(huge) and not all_finite(cases["nan"])
