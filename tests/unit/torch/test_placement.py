"""TorchWorkload beyond (inputs, targets) on the CPU: batch_loss and dict batches, devices,
bfloat16 master weights, tied weights and full state dicts, dry-run messages."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from p2ptrain.errors import LocalError
from p2ptrain.torch.placement import resolve_device
from p2ptrain.torch.workload import TorchWorkload

SEED = 99
VOCAB = 11


class TinyLM(nn.Module):
    """Embedding -> (dropout) -> tied output matrix: a few hundred parameters, plus a
    persistent buffer so that state dicts have one."""

    def __init__(self, dropout: float = 0.0, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(8, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.drop(torch.tanh(self.mix(self.embed(ids)))))
        return logits * self.scale


def _rows(n: int, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """Dict rows: input_ids and labels (the next id, mod VOCAB), as a datasets row looks."""
    rows = []
    for i in range(n):
        ids = (torch.arange(6) * (i % 3 + 1) + i + offset) % VOCAB
        rows.append({"input_ids": ids, "labels": (ids + 1) % VOCAB})
    return rows


def dict_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))


def _workload(model: nn.Module | None = None, **options: Any) -> TorchWorkload:
    torch.manual_seed(SEED)
    model = model if model is not None else TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    settings: dict[str, Any] = {"batch_loss": dict_loss, **options}
    return TorchWorkload(
        model, optimizer, _rows(32), _rows(8, offset=5), batch_size=4, samples_per_shard=16,
        name="dict-rows", val_batches=2, **settings,
    )  # fmt: skip


def test_dict_batches_train_with_a_batch_loss() -> None:
    workload = _workload()
    genesis = workload.initial_weights()
    before = workload.evaluate(genesis)
    result = workload.train_window(genesis, range(32), steps=25, seed=1)
    assert result.loss_after < result.loss_before
    assert workload.evaluate(result.weights) < before
    assert workload.autocast_dtype is None and workload.device == torch.device("cpu")
    assert not workload.language_model and workload.vocab is None
    assert len(workload.dataset_manifest().shards) == 2


def test_loss_fn_and_batch_loss_together_are_refused() -> None:
    with pytest.raises(LocalError, match="not both"):
        _workload(loss_fn=lambda logits, targets: logits.sum())


def test_dropout_in_a_window_is_a_function_of_the_seed() -> None:
    first, second = _workload(TinyLM(dropout=0.5)), _workload(TinyLM(dropout=0.5))
    genesis = first.initial_weights()
    a = first.train_window(genesis, range(32), steps=3, seed=7)
    b = second.train_window(genesis, range(32), steps=3, seed=7)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
    c = _workload(TinyLM(dropout=0.5)).train_window(genesis, range(32), steps=3, seed=8)
    assert not all(torch.equal(a.weights[n], c.weights[n]) for n in a.weights)


def test_tied_weights_are_exchanged_once_and_exported_whole() -> None:
    workload = _workload()
    assert workload.tied_parameters() == {"head.weight": "embed.weight"}
    genesis = workload.initial_weights()
    assert "head.weight" not in genesis
    trained = workload.train_window(genesis, range(32), steps=3, seed=0).weights
    state = workload.full_state_dict(trained)
    assert set(state) == {"embed.weight", "mix.weight", "mix.bias", "head.weight", "scale"}
    assert torch.equal(state["head.weight"], trained["embed.weight"])
    assert state["head.weight"].data_ptr() != state["embed.weight"].data_ptr()
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in state.values())
    fresh = TinyLM()
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.head.weight, trained["embed.weight"])
    assert fresh.head.weight is fresh.embed.weight  # still tied after loading
    untied = _workload(TinyLM(tie=False))
    assert untied.tied_parameters() == {}


def test_a_bfloat16_model_keeps_float32_master_weights_and_trains() -> None:
    model = TinyLM().to(torch.bfloat16)
    bf16_values = model.mix.weight.detach().clone()
    workload = _workload(model)
    assert workload.autocast_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in workload.model.parameters())
    genesis = workload.initial_weights()
    assert genesis["mix.weight"].dtype == torch.float32
    assert torch.equal(genesis["mix.weight"], bf16_values.float())
    result = workload.train_window(genesis, range(32), steps=25, seed=1)
    assert all(t.dtype == torch.float32 for t in result.weights.values())
    assert result.loss_after < result.loss_before
    # the float32 master weights are not rounded to bfloat16 after a step
    assert not torch.equal(result.weights["mix.weight"], result.weights["mix.weight"].bfloat16())
    with pytest.raises(LocalError, match="mixes bfloat16 and float16"):
        mixed = TinyLM(tie=False)
        mixed.embed.to(torch.bfloat16)
        mixed.mix.to(torch.float16)
        _workload(mixed)


def test_unknown_or_unavailable_devices_are_clear_errors() -> None:
    with pytest.raises(LocalError, match=r"'tpu9' is not a PyTorch device.*device='cpu'"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(LocalError, match=r"'cuda' is not available.*device='cpu'"):
            _workload(device="cuda")
    with pytest.raises(LocalError, match=r"'cuda:64' (is not available|does not exist)"):
        resolve_device("cuda:64")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


class _DeviceToHost(TorchDispatchMode):
    """Counts tensor copies from ``device`` to the CPU, and scalar reads (``.item()``) of
    tensors on ``device`` unless it is the CPU (where AdamW reads its step counts each step,
    which moves nothing)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        aten = torch.ops.aten
        on_device = self.device.type
        if func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            if source.device.type == on_device and out.device.type == "cpu":
                self.copies += 1
        elif func is aten._local_scalar_dense.default and on_device != "cpu":
            self.copies += int(args[0].device.type == on_device)
        return out


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_window_copies_weights_to_the_cpu_once_whatever_its_steps(device: str) -> None:
    workload = _workload(device=device)
    params = [p for p in workload.model.parameters()]
    assert all(p.device.type == device for p in params)
    genesis = workload.initial_weights()
    counts = []
    for steps in (2, 6):
        with _DeviceToHost(workload.device) as counter:
            result = workload.train_window(genesis, range(32), steps=steps, seed=0)
        counts.append(counter.copies)
        assert all(
            t.device.type == "cpu" and t.dtype == torch.float32 for t in result.weights.values()
        )
    assert counts[0] == counts[1], counts  # nothing per step
    if device != "cpu":  # one copy per parameter, plus the window's losses
        assert len(params) <= counts[0] <= len(params) + 2, counts
    with _DeviceToHost(workload.device) as counter:
        workload.evaluate(genesis)
    assert counter.copies <= 2 * len(params) + 2


def test_dry_run_passes_and_leaves_no_trace() -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.BatchNorm1d(6), nn.Linear(8, VOCAB))
    workload = _workload(model)
    workload.train_window(workload.initial_weights(), range(32), steps=2, seed=0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    state = workload.optimizer_state()
    rng = torch.get_rng_state()
    loss = workload.dry_run()
    assert 0 < loss < 10
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(torch.equal(t, workload.optimizer_state()[n]) for n, t in state.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class _OutputModel(nn.Module):
    """Returns a dict subclass named like transformers' output, as an HF model does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyLM()

    def forward(self, ids: torch.Tensor) -> Any:
        output_type = type("CausalLMOutputWithPast", (OrderedDict,), {})
        return output_type(logits=self.inner(ids))


def _pairs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(row["input_ids"], row["labels"]) for row in _rows(n)]


def _pair_workload(model: nn.Module, **options: Any) -> TorchWorkload:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TorchWorkload(
        model, optimizer, options.pop("train", _pairs(8)), _pairs(4), batch_size=4,
        samples_per_shard=8, name="pairs", **options,
    )  # fmt: skip


def test_dry_run_words_common_mistakes() -> None:
    with pytest.raises(
        LocalError, match=r"returned CausalLMOutputWithPast.*hf-causal-lm.*batch_loss"
    ):
        _pair_workload(_OutputModel()).dry_run()
    with pytest.raises(LocalError, match=r"returned CausalLMOutputWithPast"):  # in training too
        workload = _pair_workload(_OutputModel())
        workload.train_window(workload.initial_weights(), range(8), steps=1, seed=0)
    per_token = _pair_workload(TinyLM(), loss_fn=lambda logits, targets: logits.mean(-1))
    with pytest.raises(LocalError, match=r"shape \[4, 6\], not a scalar.*mean"):
        per_token.dry_run()
    nan = _pair_workload(TinyLM(), loss_fn=lambda logits, targets: logits.sum() * float("nan"))
    with pytest.raises(LocalError, match="loss of the first training batch is nan"):
        nan.dry_run()
    detached = _pair_workload(TinyLM(), loss_fn=lambda logits, targets: logits.sum().detach())
    with pytest.raises(LocalError, match="does not depend on the model's parameters"):
        detached.dry_run()
    dicts = _pair_workload(TinyLM(), train=_rows(8))
    with pytest.raises(LocalError, match=r"\(inputs, targets\).*'input_ids'.*batch_loss"):
        dicts.dry_run()
    strings = _pair_workload(TinyLM(), train=[("to be", 1)] * 8)
    with pytest.raises(LocalError, match=r"sample 0 holds a str.*tensors, numbers"):
        strings.dry_run()
    ragged = _pair_workload(TinyLM(), train=[(torch.zeros(i + 1).long(), 0) for i in range(8)])
    with pytest.raises(LocalError, match="collate_fn could not batch"):
        ragged.dry_run()
