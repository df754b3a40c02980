"""The ``Workload`` protocol a trainer drives, and its PyTorch implementation.

A node's trainer knows nothing about models: each window it hands the canonical weights and
its lease's sample indices to a :class:`Workload`, gets the locally trained weights back, and
encodes ``theta_base - theta_local`` (DESIGN §4, step 2). Validators call :meth:`evaluate`.
The protocol is small so that a workload that is not a plain ``torch.nn.Module`` (JAX, a
pipeline, a simulator) can implement it directly.

:class:`TorchWorkload` implements it for a module, an inner optimizer and two map-style
datasets. The things that make DiLoCo work, and that tests pin down:

* **One optimizer for the whole run.** ``train_window`` loads the window's base weights into
  the model's parameters in place and steps the *same* optimizer object every window, so its
  state (AdamW moments) carries across windows, as DiLoCo's inner optimizer state does.
  :meth:`optimizer_state` / :meth:`load_optimizer_state` save and restore it exactly, so a
  restarted trainer continues bit-for-bit.
* **Seeded minibatches.** The minibatches of a window are a pure function of the lease
  indices, the batch size, the step count and the seed (:func:`minibatch_plan`), which is what
  lets :mod:`p2ptrain.torch.baseline` replay exactly the same samples as synchronous data
  parallel training.
* **Weights are the parameters.** The weights are ``model.named_parameters()`` (float32, on
  the CPU when returned); buffers are not exchanged, so a workload whose buffers matter
  (BatchNorm running statistics) must keep them out of the model or accept local buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from p2ptrain.core.manifests import DatasetManifest
from p2ptrain.data.shards import MapDataset, dataset_manifest, number_tensor
from p2ptrain.errors import LocalError

__all__ = [
    "LOSS_AFTER_STEPS",
    "LossFn",
    "TorchWorkload",
    "WindowResult",
    "Workload",
    "cross_entropy_loss",
    "minibatch_plan",
    "train_step",
]

Tensors = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Collate = Callable[[list[Any]], Any]

#: ``loss_after`` is the mean training loss of this many last inner steps (fewer when the
#: window has fewer steps): one minibatch is too noisy to compare windows by.
LOSS_AFTER_STEPS = 8

#: Gradients are clipped to this global norm before every inner step.
CLIP_NORM = 1.0


class WindowResult(NamedTuple):
    """What one window of local training produced."""

    #: The local weights after the window: detached float32 CPU tensors.
    weights: dict[str, torch.Tensor]
    #: Loss of the window's first minibatch before any step.
    loss_before: float
    #: Mean loss of the last :data:`LOSS_AFTER_STEPS` steps (each measured before its step).
    loss_after: float
    #: Samples processed: ``steps * batch_size`` (a lease smaller than that is cycled).
    samples: int


@runtime_checkable
class Workload(Protocol):
    """What a trainer trains and a validator evaluates (DESIGN §7)."""

    def initial_weights(self) -> dict[str, torch.Tensor]:
        """The genesis weights: float32, CPU, contiguous; the same for the same config."""
        ...

    def dataset_manifest(self) -> DatasetManifest:
        """The training set's shards (names, content hashes, sample counts)."""
        ...

    @property
    def batch_size(self) -> int:
        """Samples per inner step."""
        ...

    def train_window(
        self,
        weights: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        steps: int,
        seed: int,
    ) -> WindowResult:
        """``steps`` inner steps from ``weights`` on the samples ``indices``."""
        ...

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        """Validation loss of ``weights`` on a fixed validation subset (deterministic)."""
        ...

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's state as flat named tensors (safetensors-encodable)."""
        ...

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`optimizer_state` returned."""
        ...


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``targets`` ``[B, T]``, or
    ``[B, C]`` against ``[B]``."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def minibatch_plan(
    indices: Sequence[int], *, steps: int, batch_size: int, seed: int
) -> list[list[int]]:
    """The dataset indices of each of ``steps`` minibatches: ``indices`` in an order shuffled
    by a ``torch.Generator`` seeded with ``seed``, reshuffled (same generator) each time they
    run out, cut into consecutive runs of ``batch_size``."""
    if not indices:
        raise LocalError("a window needs at least one sample index; the lease is empty")
    if steps < 1 or batch_size < 1:
        raise LocalError(f"steps and batch_size must be positive, got {steps} and {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    order: list[int] = []
    while len(order) < needed:
        order.extend(indices[i] for i in torch.randperm(len(indices), generator=generator).tolist())
    return [order[k * batch_size : (k + 1) * batch_size] for k in range(steps)]


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(part, device) for part in batch)
    return batch


def _split(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    raise LocalError(
        "a training batch must be (inputs, targets); make the dataset return pairs "
        "or pass a collate_fn that builds them"
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn,
) -> float:
    """One inner step on a collated ``(inputs, targets)`` batch: forward, backward, clip the
    global gradient norm to :data:`CLIP_NORM`, step. Returns the loss before the step."""
    device = next(model.parameters()).device
    inputs, targets = _split(_to_device(batch, device))
    loss = loss_fn(model(inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    optimizer.step()
    return float(loss.detach())


def parameter_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by name (tied parameters once), checked to be float32."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if param.dtype != torch.float32:
            raise LocalError(
                f"parameter {name!r} is {param.dtype}; p2ptrain exchanges float32 weights: "
                "keep the module in float32 (use autocast for lower-precision compute)"
            )
    if not params:
        raise LocalError("the model has no parameters to train")
    return params


def load_weights(params: Mapping[str, nn.Parameter], weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into the parameters in place (optimizers keep their references)."""
    missing, extra = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
    if missing or extra:
        raise LocalError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}; "
            "the head was made for another model (check the experiment's workload config)"
        )
    with torch.no_grad():
        for name, param in params.items():
            value = weights[name]
            if value.shape != param.shape:
                raise LocalError(
                    f"weight {name!r} has shape {tuple(value.shape)}, the model's is "
                    f"{tuple(param.shape)}; check the experiment's workload config"
                )
            param.copy_(value)


def snapshot(params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Detached float32 CPU contiguous copies of the parameters."""
    return {
        name: param.detach().to("cpu", torch.float32, copy=True).contiguous()
        for name, param in params.items()
    }


class TorchWorkload:
    """A :class:`Workload` over a ``torch.nn.Module``, its inner optimizer and datasets.

    ``train_dataset[i]`` and ``val_dataset[i]`` are samples that ``collate_fn`` (default
    :func:`torch.utils.data.default_collate`) turns into ``(inputs, targets)``; the loss is
    ``loss_fn(model(inputs), targets)`` (default :func:`cross_entropy_loss`). The genesis
    weights are the model's parameters when the workload is built. Evaluation uses
    ``val_batches`` batches of ``eval_batch_size`` (default ``batch_size``) samples spread
    evenly over the validation set.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: MapDataset,
        val_dataset: MapDataset,
        *,
        batch_size: int,
        samples_per_shard: int,
        name: str,
        loss_fn: LossFn | None = None,
        val_batches: int = 8,
        eval_batch_size: int | None = None,
        collate_fn: Collate | None = None,
    ) -> None:
        if batch_size < 1 or val_batches < 1:
            raise LocalError(
                f"batch_size and val_batches must be positive, got {batch_size}, {val_batches}"
            )
        if len(val_dataset) < 1:
            raise LocalError("the validation dataset is empty; evaluation needs samples")
        self.model = model
        self.optimizer = optimizer
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.name = name
        self.samples_per_shard = samples_per_shard
        self.loss_fn: LossFn = loss_fn or cross_entropy_loss
        self.collate_fn: Collate = collate_fn or default_collate
        self._batch_size = batch_size
        self._params = parameter_names(model)
        self._check_optimizer()
        self._initial = snapshot(self._params)
        self._manifest: DatasetManifest | None = None
        eval_size = eval_batch_size or batch_size
        count = min(len(val_dataset), val_batches * eval_size)
        spread = [i * len(val_dataset) // count for i in range(count)]
        self._val_batches = [spread[i : i + eval_size] for i in range(0, count, eval_size)]

    @classmethod
    def from_loaders(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: DataLoader[Any],
        val_loader: DataLoader[Any],
        *,
        samples_per_shard: int,
        name: str,
        loss_fn: LossFn | None = None,
        val_batches: int = 8,
    ) -> TorchWorkload:
        """A workload from the loaders a plain training loop would use: their datasets,
        the train loader's batch size and collate function (sampling is the protocol's)."""
        batch_size = train_loader.batch_size
        if batch_size is None:
            raise LocalError(
                "train_loader has no batch_size (it uses a batch_sampler); build it with "
                "DataLoader(dataset, batch_size=...)"
            )
        return cls(
            model,
            optimizer,
            train_loader.dataset,  # type: ignore[arg-type]
            val_loader.dataset,  # type: ignore[arg-type]
            batch_size=batch_size,
            samples_per_shard=samples_per_shard,
            name=name,
            loss_fn=loss_fn,
            val_batches=val_batches,
            eval_batch_size=val_loader.batch_size,
            collate_fn=train_loader.collate_fn,
        )

    def _check_optimizer(self) -> None:
        known = {id(p) for p in self._params.values()}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in known:
                    raise LocalError(
                        "the optimizer holds a tensor that is not a parameter of the model; "
                        "build it from model.parameters()"
                    )

    #: A language model's loss is a token cross-entropy: evaluators report exp(loss) too.
    language_model: bool = False

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def validation_samples(self) -> int:
        """How many validation samples :meth:`evaluate` runs on."""
        return sum(len(batch) for batch in self._val_batches)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self._initial.items()}

    def dataset_manifest(self) -> DatasetManifest:
        if self._manifest is None:
            self._manifest = dataset_manifest(
                self.train_dataset, name=self.name, samples_per_shard=self.samples_per_shard
            )
        return self._manifest

    def collate(self, indices: Sequence[int], dataset: MapDataset | None = None) -> Any:
        source = self.train_dataset if dataset is None else dataset
        return self.collate_fn([source[i] for i in indices])

    def train_window(
        self,
        weights: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        steps: int,
        seed: int,
    ) -> WindowResult:
        plan = minibatch_plan(indices, steps=steps, batch_size=self._batch_size, seed=seed)
        load_weights(self._params, weights)
        self.model.train()
        losses = [
            train_step(self.model, self.optimizer, self.collate(batch), self.loss_fn)
            for batch in plan
        ]
        tail = losses[-LOSS_AFTER_STEPS:]
        return WindowResult(
            weights=snapshot(self._params),
            loss_before=losses[0],
            loss_after=sum(tail) / len(tail),
            samples=steps * self._batch_size,
        )

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        """Loads ``weights`` into the model (``train_window`` loads its own) and evaluates."""
        load_weights(self._params, weights)
        return self.evaluate_model(self.model)

    def evaluate_model(self, model: nn.Module) -> float:
        """Validation loss of ``model`` as it is (eval mode, no gradients)."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for batch_indices in self._val_batches:
                    batch = _to_device(self.collate(batch_indices, self.val_dataset), device)
                    inputs, targets = _split(batch)
                    loss = self.loss_fn(model(inputs), targets)
                    total += float(loss) * len(batch_indices)
                    count += len(batch_indices)
        finally:
            model.train(was_training)
        return total / count

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """``f"{parameter}/{key}"`` for every per-parameter state entry (numbers, such as
        a step count, become 0-d tensors: float64 for floats, int64 for ints)."""
        name_of = {id(param): name for name, param in self._params.items()}
        flat: dict[str, torch.Tensor] = {}
        for param, state in self.optimizer.state.items():
            name = name_of[id(param)]
            for key, value in state.items():
                flat[f"{name}/{key}"] = _state_tensor(name, key, value)
        return flat

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the optimizer's per-parameter state with ``tensors`` (from
        :meth:`optimizer_state`); tensors move to their parameter's device, except 0-d ones
        (step counts), which PyTorch optimizers keep on the CPU."""
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for flat_name, tensor in tensors.items():
            name, _, key = flat_name.rpartition("/")
            if name not in self._params or not key:
                raise LocalError(
                    f"optimizer state entry {flat_name!r:.80} names no parameter of the model; "
                    "the state was saved for another model: start the inner optimizer afresh"
                )
            grouped.setdefault(name, {})[key] = tensor
        self.optimizer.state.clear()
        for name, entries in grouped.items():
            param = self._params[name]
            self.optimizer.state[param] = {
                key: value.detach().clone() if value.ndim == 0 else value.to(param.device).clone()
                for key, value in entries.items()
            }


def _state_tensor(name: str, key: str, value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).contiguous()
    number = number_tensor(value)
    if number is not None:
        return number
    raise LocalError(
        f"optimizer state {name}/{key} is a {type(value).__name__}, which cannot be saved as "
        "a tensor; use an optimizer whose state is tensors and numbers"
    )
