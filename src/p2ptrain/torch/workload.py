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
  the CPU when returned; a tied parameter once, :meth:`TorchWorkload.tied_parameters` names
  its aliases); buffers are not exchanged, so a workload whose buffers matter (BatchNorm
  running statistics) must keep them out of the model or accept local buffers.
* **Any batch, any device, low precision.** The loss of a batch is ``batch_loss(model,
  batch)`` (:mod:`.batch_loss`; ``(inputs, targets)`` batches with ``loss_fn`` by default).
  The model lives on ``device``: a window loads its base weights onto the device once, runs
  every inner step there and copies the weights back to the CPU once, at the end. A bfloat16
  or float16 model trains float32 master weights under autocast (:mod:`.placement`).
* **Mistakes early.** :meth:`TorchWorkload.dry_run` runs one batch forward and backward and
  words what is wrong (:mod:`.dry_run`).
* **Honest validation.** The validation set is the workload's own, or (``val_from_data``)
  the validation split of the prepared data the node attaches (:meth:`use_data`). A
  workload without validation data says why (:attr:`TorchWorkload.validation_missing`) and
  :meth:`evaluate` refuses with that reason: it never reports a loss on other data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, default_collate

from p2ptrain.core.manifests import DatasetManifest, TokenizerSpec
from p2ptrain.data.pipelines import DataPipeline, ShardMissing, as_pipeline
from p2ptrain.data.shards import MapDataset
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import (
    CLIP_NORM,
    BatchLoss,
    Collate,
    LossFn,
    PairLoss,
    cross_entropy_loss,
    inner_step,
    to_device,
    train_step,
)
from p2ptrain.torch.dry_run import check_rows, collate_rows, dry_run_batch
from p2ptrain.torch.optimizer_state import flatten_optimizer_state, restore_optimizer_state
from p2ptrain.torch.placement import (
    autocast_context,
    keep_master_weights,
    resolve_device,
    seeded_rng,
)
from p2ptrain.torch.weights import (
    load_weights,
    parameter_names,
    snapshot,
    state_dict_copies,
    tied_parameters,
)

__all__ = [
    "CLIP_NORM",
    "LOSS_AFTER_STEPS",
    "BatchLoss",
    "LossFn",
    "TorchWorkload",
    "WindowResult",
    "Workload",
    "cross_entropy_loss",
    "load_weights",
    "minibatch_plan",
    "parameter_names",
    "snapshot",
    "train_step",
]

Tensors = dict[str, torch.Tensor]

#: ``loss_after`` is the mean training loss of this many last inner steps (fewer when the
#: window has fewer steps): one minibatch is too noisy to compare windows by.
LOSS_AFTER_STEPS = 8


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


class TorchWorkload:
    """A :class:`Workload` over a ``torch.nn.Module``, its inner optimizer and datasets.

    ``train_dataset[i]`` and ``val_dataset[i]`` are samples (tensors, numbers, or tuples or
    dicts of them) that ``collate_fn`` (default :func:`torch.utils.data.default_collate`)
    batches. The loss of a batch is ``batch_loss(model, batch)`` when given, else the batch
    is ``(inputs, targets)`` and the loss ``loss_fn(model(inputs), targets)`` (default
    :func:`cross_entropy_loss`). The model is moved to ``device``; a bfloat16/float16 model is
    kept as float32 master weights with its forward under autocast (``autocast_dtype``). The
    genesis weights are the model's parameters when the workload is built. Evaluation uses
    ``val_batches`` batches of ``eval_batch_size`` (default ``batch_size``) samples spread
    evenly over the validation set. ``language_model`` says the loss is a per-token
    cross-entropy (evaluators then report perplexity, ``exp(loss)``); ``vocab`` (the string of
    each token id), when set, lets exports decode token ids, and ``tokenizer`` (a prepared
    text dataset's) says how the ids were made.

    ``val_from_data``: ``val_dataset`` is None and the validation set is the validation
    split of the training data (``pipeline.validation_view()``, a prepared dataset's
    held-out shards), taken again whenever :meth:`use_data` attaches data; without one the
    workload has no validation data (:attr:`validation_missing` says why).
    ``example_rows``: rows of the data's form (a few suffice) that :meth:`dry_run` runs on
    when neither training nor validation rows are on this machine yet. ``pod_wrap``: how a
    pod of ranks wraps the model, ``"ddp"`` or ``"fsdp2"`` (sharded, for a model that does
    not fit one device).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_dataset: MapDataset | DataPipeline | None,
        val_dataset: MapDataset | None,
        *,
        batch_size: int,
        samples_per_shard: int,
        name: str,
        loss_fn: LossFn | None = None,
        val_batches: int = 8,
        eval_batch_size: int | None = None,
        collate_fn: Collate | None = None,
        batch_loss: BatchLoss | None = None,
        device: torch.device | str = "cpu",
        language_model: bool = False,
        vocab: Sequence[str] | None = None,
        tokenizer: TokenizerSpec | None = None,
        val_from_data: bool = False,
        example_rows: MapDataset | None = None,
        pod_wrap: str = "ddp",
    ) -> None:
        if pod_wrap not in ("ddp", "fsdp2"):
            raise LocalError(f"pod_wrap {pod_wrap!r}: use 'ddp' or 'fsdp2'")
        #: How a pod wraps the model (``--pod-wrap`` overrides it): DDP, or FSDP2 for a
        #: model that does not fit one device.
        self.pod_wrap = pod_wrap
        if batch_size < 1 or val_batches < 1:
            raise LocalError(
                f"batch_size and val_batches must be positive, got {batch_size}, {val_batches}"
            )
        if val_from_data != (val_dataset is None):
            raise LocalError(
                "give a validation dataset, or val_from_data=True to validate on the "
                "validation split of the attached data (not both)"
            )
        if val_dataset is not None:
            _check_map_style("validation", val_dataset)
            if len(val_dataset) < 1:
                raise LocalError("the validation dataset is empty; evaluation needs samples")
        if loss_fn is not None and batch_loss is not None:
            raise LocalError(
                "pass loss_fn (for (inputs, targets) batches) or batch_loss (any batch), not both"
            )
        self.device = resolve_device(device)
        self.autocast_dtype = keep_master_weights(model)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.data: DataPipeline | None = (
            None
            if train_dataset is None
            else as_pipeline(train_dataset, name=name, samples_per_shard=samples_per_shard)
        )
        self.name = name
        self.samples_per_shard = samples_per_shard
        self.language_model = language_model
        self.vocab: tuple[str, ...] | None = None if vocab is None else tuple(vocab)
        self.tokenizer = tokenizer
        self.val_from_data = val_from_data
        self.example_rows = example_rows
        self.loss_fn: LossFn = loss_fn or cross_entropy_loss
        self.batch_loss: BatchLoss = batch_loss or PairLoss(self.loss_fn)
        self.collate_fn: Collate = collate_fn or default_collate
        self._batch_size = batch_size
        self._params = parameter_names(model)
        self._tied = tied_parameters(model)
        self._check_optimizer()
        #: Each parameter group's learning rate as built: what set_lr_scale multiplies.
        self._base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._initial = snapshot(self._params)
        self._eval_size = eval_batch_size or batch_size
        self._val_count = val_batches * self._eval_size
        self.val_dataset: MapDataset | None = None
        self._val_batches: list[list[int]] = []
        self._set_validation(val_dataset if not val_from_data else self._data_validation())

    def _data_validation(self) -> MapDataset | None:
        """The attached data's validation split (None: it has none)."""
        split = getattr(self.data, "validation_view", None)
        return split() if callable(split) else None

    def _set_validation(self, dataset: MapDataset | None) -> None:
        """Evaluate on ``dataset``: ``val_batches`` batches spread evenly over it."""
        self.val_dataset = dataset
        self._val_batches = []
        if dataset is None or len(dataset) < 1:
            self.val_dataset = None
            return
        count = min(len(dataset), self._val_count)
        spread = [i * len(dataset) // count for i in range(count)]
        size = self._eval_size
        self._val_batches = [spread[i : i + size] for i in range(0, count, size)]

    @property
    def validation_missing(self) -> str | None:
        """Why this workload has no validation data (None: it has some)."""
        if self.val_dataset is not None:
            return None
        if self.data is None:
            return (
                f"workload {self.name!r} validates on the validation split of its prepared "
                "data, which is not attached yet"
            )
        manifest = self.data.dataset_manifest()
        return (
            f"the prepared dataset {manifest.name!r} has no validation split, and workload "
            f"{self.name!r} validates on nothing else (never on other data): prepare it "
            "again with a split, p2ptrain data prepare SOURCE --out DIR --val-fraction 0.1 "
            "(with the same other options)"
        )

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
        batch_loss: BatchLoss | None = None,
        device: torch.device | str = "cpu",
        language_model: bool = False,
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
            batch_loss=batch_loss,
            device=device,
            language_model=language_model,
        )

    def place(self, device: torch.device | str) -> None:
        """Move the model (and so its training) to ``device``; the optimizer keeps its
        parameters (they move in place)."""
        self.device = resolve_device(device)
        self.model.to(self.device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    state[key] = value.to(self.device)

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
        """How many validation samples :meth:`evaluate` runs on (0: none, see
        :attr:`validation_missing`)."""
        return sum(len(batch) for batch in self._val_batches)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self._initial.items()}

    def tied_parameters(self) -> dict[str, str]:
        """``{alias: canonical}``: parameter names of the module that are the same tensor as
        an exchanged weight listed under ``canonical`` (e.g. a tied LM head)."""
        return dict(self._tied)

    def full_state_dict(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loads ``weights`` into the model and returns its whole ``state_dict()`` (tied
        aliases and persistent buffers included) as contiguous CPU tensors that own their
        storage: what ``model.load_state_dict(..., strict=True)`` and safetensors accept."""
        load_weights(self._params, weights)
        return state_dict_copies(self.model)

    @property
    def train_dataset(self) -> MapDataset:
        """The training samples by global index (the data pipeline's view)."""
        return self.pipeline.view()

    @property
    def pipeline(self) -> DataPipeline:
        """Where the training samples come from (see :mod:`p2ptrain.data.pipelines`)."""
        if self.data is None:
            raise LocalError(
                f"workload {self.name!r} has no training data of its own: its experiment's "
                'data comes from prepared shards ([data] prepared = "DIR"), which a node '
                "attaches with use_data()"
            )
        return self.data

    def use_data(self, pipeline: DataPipeline) -> None:
        """Train on ``pipeline`` (a node attaches an experiment's prepared shards here); a
        workload that validates on the data's split (``val_from_data``) takes its split."""
        self.data = pipeline
        if self.val_from_data:
            self._set_validation(self._data_validation())

    def dataset_manifest(self) -> DatasetManifest:
        return self.pipeline.dataset_manifest()

    def collate(self, indices: Sequence[int], dataset: MapDataset | None = None) -> Any:
        source = self.train_dataset if dataset is None else dataset
        return self.collate_fn([source[i] for i in indices])

    def dry_run(self) -> float:
        """The loss of the first training batch after one forward and backward, checking the
        rows, the batch, the model's output and the loss; raises :class:`LocalError` saying
        what to change. Weights and optimizer state are left exactly as they were. Data that
        is not on this machine yet (prepared shards, a custom loader) is stood in for by the
        validation set, whose rows have the same form, or else by ``example_rows``."""
        source = self._dry_run_rows()
        indices = list(range(min(self._batch_size, len(source))))
        if not indices:
            raise LocalError("the training dataset is empty; training needs samples")
        check_rows(source, indices)
        batch = collate_rows(lambda rows: self.collate(rows, source), indices)
        return dry_run_batch(self.model, batch, self.batch_loss, self.autocast_dtype)

    def _dry_run_rows(self) -> MapDataset:
        """The first rows on this machine of: the training data, the validation data, the
        example rows."""
        if self.data is not None and self.data.kind in ("indexed", "generated"):
            return self.train_dataset
        sharded = self.data is not None and self.data.kind == "sharded"
        candidates = [self.train_dataset] if sharded else []
        candidates += [rows for rows in (self.val_dataset, self.example_rows) if rows is not None]
        for rows in candidates:
            if _on_this_machine(rows):
                return rows
        raise LocalError(
            f"workload {self.name!r}: no training or validation rows are on this machine for "
            "the dry run (its data comes from the network); give the workload example_rows "
            "of the data's form"
        )

    def train_window(
        self,
        weights: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        steps: int,
        seed: int,
    ) -> WindowResult:
        """Loads ``weights`` onto the device once, runs the steps there (dropout seeded
        with ``seed``) and copies the weights back to the CPU once."""
        plan = minibatch_plan(indices, steps=steps, batch_size=self._batch_size, seed=seed)
        load_weights(self._params, weights)
        self.model.train()
        with seeded_rng(self.device, seed):
            losses = [
                inner_step(
                    self.model,
                    self.optimizer,
                    self.collate(batch),
                    self.batch_loss,
                    self.autocast_dtype,
                )
                for batch in plan
            ]
        values: list[float] = torch.stack(losses).tolist()
        tail = values[-LOSS_AFTER_STEPS:]
        return WindowResult(
            weights=snapshot(self._params),
            loss_before=values[0],
            loss_after=sum(tail) / len(tail),
            samples=steps * self._batch_size,
        )

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        """Loads ``weights`` into the model (``train_window`` loads its own) and evaluates."""
        load_weights(self._params, weights)
        return self.evaluate_model(self.model)

    def evaluate_model(self, model: nn.Module) -> float:
        """Validation loss of ``model`` as it is (eval mode, no gradients, on its device);
        a :class:`LocalError` saying why when the workload has no validation data."""
        dataset = self.val_dataset
        if dataset is None:
            raise LocalError(f"no validation loss: {self.validation_missing}")
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        losses: list[torch.Tensor] = []
        try:
            with torch.no_grad(), autocast_context(device, self.autocast_dtype):
                for batch_indices in self._val_batches:
                    batch = to_device(self.collate(batch_indices, dataset), device)
                    losses.append(self.batch_loss(model, batch).detach().float().reshape(()))
        finally:
            model.train(was_training)
        total, count = 0.0, 0
        for value, batch_indices in zip(
            torch.stack(losses).tolist(), self._val_batches, strict=True
        ):
            total += value * len(batch_indices)
            count += len(batch_indices)
        return total / count

    @property
    def base_lrs(self) -> tuple[float, ...]:
        """Each parameter group's learning rate as the optimizer was built (before any
        :meth:`set_lr_scale`)."""
        return tuple(self._base_lrs)

    def set_lr_scale(self, scale: float) -> None:
        """Train at ``scale`` times every parameter group's learning rate as the optimizer
        was built (the manifest's inner schedule, set before each window)."""
        scale_learning_rates(self.optimizer, self._base_lrs, scale)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """``f"{parameter}/{key}"`` for every per-parameter state entry (numbers, such as
        a step count, become 0-d tensors: float64 for floats, int64 for ints)."""
        return flatten_optimizer_state(self.optimizer, self._params)

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the optimizer's per-parameter state with ``tensors`` (from
        :meth:`optimizer_state`), on the parameters' device."""
        restore_optimizer_state(self.optimizer, self._params, tensors)


def scale_learning_rates(
    optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], scale: float
) -> None:
    """Set each parameter group's learning rate to ``scale`` times its ``base_lrs`` entry."""
    if not math.isfinite(scale) or scale < 0:
        raise LocalError(f"the learning-rate scale must be finite and >= 0, got {scale}")
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * scale


def _on_this_machine(rows: MapDataset) -> bool:
    """Whether the first row of ``rows`` can be read here (a prepared shard may still have
    to be fetched)."""
    try:
        return len(rows) > 0 and rows[0] is not None
    except ShardMissing:
        return False


def _check_map_style(role: str, dataset: object) -> None:
    """Leases name samples by index: a dataset must have ``len()`` and ``dataset[i]``."""
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise LocalError(
            f"the {role} dataset is a {type(dataset).__name__}, a stream without len() and "
            "dataset[i]; the protocol leases samples by index, so it needs a map-style "
            "dataset: materialise the stream (a list of rows, a datasets.Dataset, or a "
            "torch Dataset over files cut into fixed blocks)"
        )
