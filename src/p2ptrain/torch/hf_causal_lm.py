"""Hugging Face causal language models as workloads (the ``hf`` extra: ``transformers``).

Two ways in:

* :func:`causal_lm_workload` wraps a model you built (any module whose ``forward`` takes
  ``input_ids``, ``attention_mask`` and ``labels`` and returns an output with ``.loss``, as
  ``AutoModelForCausalLM`` models do) and your map-style datasets. A row is a 1-D tensor of
  token ids (the labels are the ids: the model shifts them itself) or a dict with
  ``input_ids``, optionally ``attention_mask`` and ``labels`` (without ``labels``, the ids
  where the mask is 1, ``-100`` elsewhere), as ``datasets.Dataset.with_format("torch")``
  returns. The loss of a batch is ``model(**batch).loss``.
* :func:`hf_causal_lm_workload` is the manifest's ``[workload] name = "hf-causal-lm"``: every
  peer builds the same model from ``[workload.config]`` alone. ``model_type`` (``"gpt2"``,
  ``"llama"``, ...) with size keys passed to ``AutoConfig.for_model`` (``n_layer``,
  ``n_embd``, ``hidden_size``, ...), seeded with ``seed`` so that the genesis weights are the
  same bits everywhere; or ``pretrained``, a local directory (never a download: every peer
  must hold the same files). The data is the bundled Shakespeare corpus, character-level
  (:mod:`p2ptrain.data.shakespeare`), cut into rows of ``block_size`` tokens; the vocabulary
  defaults to the corpus's characters, kept as ``workload.vocab`` for exports. When the
  experiment names prepared text (``[data] prepared``), the data, the vocabulary and the
  validation split are that dataset's instead (:mod:`p2ptrain.torch.prepared_text`):
  ``vocab_size`` defaults to the dataset's (a smaller one is refused), ``block_size`` is its
  rows' length (another is refused), and without a validation split there is no
  validation loss.

``import p2ptrain`` never imports ``transformers``: this module imports it when a model is
built from a config, and says how to install it when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import torch
from torch import nn
from torch.utils.data import default_collate

from p2ptrain.core.manifests import DatasetManifest, TokenizerSpec
from p2ptrain.data.pipelines import DataPipeline
from p2ptrain.data.shakespeare import ShakespeareChars
from p2ptrain.data.shards import MapDataset
from p2ptrain.errors import LocalError
from p2ptrain.torch.prepared_text import PreparedText, prepared_text
from p2ptrain.torch.workload import TorchWorkload

__all__ = [
    "DEFAULT_CONFIG",
    "causal_lm_batch",
    "causal_lm_loss",
    "causal_lm_workload",
    "hf_causal_lm_workload",
    "import_transformers",
]

ConfigValue = str | int | float | bool

#: The settings of the hf-causal-lm workload that are not the model's (the model's come
#: from ``model_type`` and size keys, or from ``pretrained``).
DEFAULT_CONFIG: Final[dict[str, ConfigValue]] = {
    "corpus": "shakespeare",
    "block_size": 64,
    "batch_size": 16,
    "lr": 3e-3,
    "seed": 0,
    "samples_per_shard": 256,
    "val_blocks": 256,
    "dtype": "float32",
}

_DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKEN_ID_KEYS: Final = ("bos_token_id", "eos_token_id", "pad_token_id")


def import_transformers() -> ModuleType:
    """The ``transformers`` module, or a :class:`LocalError` saying how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise LocalError(
            "Hugging Face models need the transformers package, which is not installed: "
            "pip install 'p2ptrain[hf]'"
        ) from error
    return transformers


def causal_lm_batch(rows: list[Any]) -> dict[str, torch.Tensor]:
    """Collate token-id rows (1-D tensors) or dict rows into ``input_ids``, ``labels`` and,
    when the rows have one, ``attention_mask`` (see the module docstring)."""
    if rows and all(isinstance(row, torch.Tensor) for row in rows):
        if any(row.ndim != 1 for row in rows):
            raise LocalError("a token-id row must be a 1-D tensor of ids, one row per sample")
        ids = torch.stack(rows)
        return {"input_ids": ids, "labels": ids}
    if rows and all(isinstance(row, Mapping) for row in rows):
        batch: dict[str, torch.Tensor] = default_collate(rows)
        if "input_ids" not in batch:
            raise LocalError(
                f"a dict row needs 'input_ids' (it has {sorted(batch)[:6]}); tokenize the "
                "dataset first, or rename the column that holds the token ids"
            )
        if "labels" not in batch:
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            batch["labels"] = labels if mask is None else labels.masked_fill(mask == 0, -100)
        return batch
    kinds = sorted({type(row).__name__ for row in rows})
    raise LocalError(
        f"a causal-LM row must be a 1-D tensor of token ids or a dict with 'input_ids', got "
        f"{', '.join(kinds) or 'no rows'}; an (x, y) pair is for TorchWorkload with loss_fn"
    )


def causal_lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``model(**batch).loss``, with a :class:`LocalError` when the model returns none."""
    try:
        output = model(**batch)
    except TypeError as error:
        if "unexpected keyword" not in str(error):
            raise
        raise LocalError(
            f"the model's forward does not take every key of the batch {sorted(batch)}: "
            f"{error}; drop the other columns (dataset.remove_columns([...]))"
        ) from error
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise LocalError(
            f"the model returned {type(output).__name__} without a loss: use a causal LM "
            "(AutoModelForCausalLM, not AutoModel) and give it labels"
        )
    return loss


def causal_lm_workload(
    model: nn.Module,
    train_dataset: MapDataset | DataPipeline | None,
    val_dataset: MapDataset | None,
    *,
    batch_size: int,
    samples_per_shard: int,
    name: str,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 3e-4,
    device: torch.device | str = "cpu",
    val_batches: int = 8,
    vocab: Sequence[str] | None = None,
    tokenizer: TokenizerSpec | None = None,
    val_from_data: bool = False,
    example_rows: MapDataset | None = None,
) -> TorchWorkload:
    """A :class:`TorchWorkload` for a causal LM (see the module docstring); the optimizer
    defaults to ``AdamW(model.parameters(), lr=lr)``; ``vocab`` is the string of each token
    id, kept as ``workload.vocab`` so that exports can decode ids; ``tokenizer``,
    ``val_from_data`` and ``example_rows`` are :class:`TorchWorkload`'s."""
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return TorchWorkload(
        model,
        optimizer,
        train_dataset,
        val_dataset,
        batch_size=batch_size,
        samples_per_shard=samples_per_shard,
        name=name,
        val_batches=val_batches,
        collate_fn=causal_lm_batch,
        batch_loss=causal_lm_loss,
        device=device,
        language_model=True,
        vocab=vocab,
        tokenizer=tokenizer,
        val_from_data=val_from_data,
        example_rows=example_rows,
    )


class _WholeBlocks:
    """Shakespeare blocks as 1-D token-id rows: ``x`` and the last character of ``y``."""

    def __init__(self, chars: ShakespeareChars) -> None:
        self.chars = chars

    def __len__(self) -> int:
        return len(self.chars)

    def __getitem__(self, index: int) -> torch.Tensor:
        inputs, targets = self.chars[index]
        return torch.cat((inputs, targets[-1:]))

    def stacked_samples(self, start: int, stop: int) -> tuple[torch.Tensor]:
        """Rows ``start..stop-1`` stacked: what the shard hash reads in one piece."""
        inputs, targets = self.chars.stacked_samples(start, stop)
        return (torch.cat((inputs, targets[:, -1:]), dim=1),)


def _checked(key: str, given: ConfigValue) -> ConfigValue:
    default = DEFAULT_CONFIG[key]
    if isinstance(default, float):
        ok = isinstance(given, int | float) and not isinstance(given, bool)
    else:
        ok = isinstance(given, type(default)) and not isinstance(given, bool)
    if not ok:
        raise LocalError(
            f"hf-causal-lm setting {key!r} must be of type {type(default).__name__}, got {given!r}"
        )
    if isinstance(given, int | float) and not (math.isfinite(given) and given >= 0):
        raise LocalError(f"hf-causal-lm setting {key!r} must be >= 0, got {given!r}")
    return float(given) if isinstance(default, float) else given


def _pretrained(transformers: ModuleType, path: str) -> nn.Module:
    if not Path(path).is_dir():
        raise LocalError(
            f"pretrained = {path!r:.120} is not a local directory; p2ptrain never downloads "
            "models at run time (every peer must start from the same files): download it "
            "beforehand (e.g. `hf download <name> --local-dir <dir>`), set HF_HUB_OFFLINE=1 "
            "and give the local path"
        )
    model: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True
    )
    return model


def _from_config(
    transformers: ModuleType, model_type: str, sizes: dict[str, ConfigValue], seed: int
) -> nn.Module:
    try:
        defaults = transformers.AutoConfig.for_model(model_type)
    except ValueError as error:
        raise LocalError(
            f"transformers does not know model_type {model_type!r:.80} (e.g. 'gpt2', 'llama')"
        ) from error
    known = set(defaults.to_dict()) | set(defaults.attribute_map)
    for key in sorted(sizes):
        if key not in known:
            raise LocalError(
                f"hf-causal-lm: {model_type} configs have no setting {key!r}; use one of "
                f"{sorted(DEFAULT_CONFIG)}, model_type, pretrained, or a {model_type} config key "
                f"(e.g. {', '.join(sorted(k for k in defaults.attribute_map)[:4]) or 'vocab_size'})"
            )
    vocab_size = sizes["vocab_size"]
    for key in _TOKEN_ID_KEYS:  # a default id outside a small vocabulary means none
        default_id = getattr(defaults, key, None)
        if key not in sizes and isinstance(default_id, int) and default_id >= int(vocab_size):
            sizes[key] = None  # type: ignore[assignment]
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    return model


def _positions(model: nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def hf_causal_lm_workload(
    config: Mapping[str, ConfigValue],
    *,
    device: torch.device | str = "cpu",
    dataset: DatasetManifest | None = None,
) -> TorchWorkload:
    """The hf-causal-lm workload for a manifest's ``[workload.config]`` (see the module
    docstring; missing settings take :data:`DEFAULT_CONFIG`), on the experiment's prepared
    text when ``dataset`` (the experiment's dataset manifest) is a prepared one."""
    transformers = import_transformers()
    text = prepared_text(dataset, "hf-causal-lm", dict(config))
    settings = dict(DEFAULT_CONFIG)
    sizes: dict[str, ConfigValue] = {}
    for key, given in config.items():
        if key in DEFAULT_CONFIG:
            settings[key] = _checked(key, given)
        elif key not in ("model_type", "pretrained"):
            sizes[key] = given
    if text is None and settings["corpus"] != "shakespeare":
        raise LocalError(
            f"hf-causal-lm has no corpus {settings['corpus']!r:.80}; the built-in one is "
            "'shakespeare'. For your own data, build the workload in Python with "
            "p2ptrain.torch.hf_causal_lm.causal_lm_workload(model, train, val, ...)"
        )
    dtype = _DTYPES.get(str(settings["dtype"]))
    if dtype is None:
        raise LocalError(f"hf-causal-lm dtype must be one of {sorted(_DTYPES)}")
    if text is not None:
        _check_block_size(config, text)
        settings["block_size"] = text.tokenizer.block_size
    block_size, seed, batch_size = (int(settings[k]) for k in ("block_size", "seed", "batch_size"))
    if block_size < 2 or batch_size < 1:
        raise LocalError("hf-causal-lm needs block_size >= 2 and batch_size >= 1")
    if text is None:
        train = ShakespeareChars(block_size - 1, "train")
        vocab_size, where = train.vocab_size, "the Shakespeare corpus (one per character)"
    else:
        vocab_size = text.tokenizer.vocab_size
        where = f"the prepared dataset {text.dataset.name!r}"
    model_type, pretrained = config.get("model_type"), config.get("pretrained")
    if isinstance(pretrained, str) and model_type is None and not sizes:
        model = _pretrained(transformers, pretrained)
    elif isinstance(model_type, str) and pretrained is None:
        sizes.setdefault("vocab_size", vocab_size)
        model = _from_config(transformers, model_type, sizes, seed)
    else:
        raise LocalError(
            "hf-causal-lm needs either model_type (a string such as 'gpt2', with size keys) "
            "or pretrained (a local directory, without size keys), not both"
        )
    model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(model_vocab, int) and model_vocab < vocab_size:
        raise LocalError(
            f"the model's vocab_size {model_vocab} is below the {vocab_size} ids of {where}; "
            "raise vocab_size or leave it out"
        )
    positions = _positions(model)
    if positions is not None and positions < block_size:
        raise LocalError(
            f"block_size {block_size} exceeds the model's {positions} positions; lower "
            "block_size or raise the model's positions (n_positions / max_position_embeddings)"
            if text is None
            else f"the rows of {block_size} tokens of {where} exceed the model's {positions} "
            "positions: raise them (n_positions / max_position_embeddings), or prepare the "
            "data with a smaller --block-size"
        )
    if text is not None:
        return _on_prepared_text(model.to(dtype), text, settings, device)
    val = ShakespeareChars(block_size - 1, "val")
    val_blocks = min(int(settings["val_blocks"]), len(val))
    return causal_lm_workload(
        model.to(dtype),
        _WholeBlocks(train),
        _WholeBlocks(val),
        batch_size=batch_size,
        samples_per_shard=int(settings["samples_per_shard"]),
        name=f"shakespeare-char-blocks-{block_size}",
        lr=float(settings["lr"]),
        device=device,
        val_batches=max(1, math.ceil(val_blocks / batch_size)),
        vocab=tuple(train.vocab),
    )


def _check_block_size(config: Mapping[str, ConfigValue], text: PreparedText) -> None:
    given, rows = config.get("block_size"), text.tokenizer.block_size
    if given is not None and given != rows:
        raise LocalError(
            f"hf-causal-lm: block_size = {given!r:.20}, but the prepared dataset "
            f"{text.dataset.name!r} has rows of {rows} tokens: leave block_size out (it is "
            "the rows' length), or prepare the data again with --block-size "
            f"{given!r:.20}"
        )


def _on_prepared_text(
    model: nn.Module,
    text: PreparedText,
    settings: Mapping[str, ConfigValue],
    device: torch.device | str,
) -> TorchWorkload:
    """The workload on the experiment's prepared text: its shards (attached by the node),
    its tokenizer and its validation split."""
    batch_size = int(settings["batch_size"])
    val_blocks = min(int(settings["val_blocks"]), max(1, text.dataset.validation_samples))
    return causal_lm_workload(
        model,
        text.pipeline,
        None,
        batch_size=batch_size,
        samples_per_shard=int(settings["samples_per_shard"]),
        name=text.dataset.name,
        lr=float(settings["lr"]),
        device=device,
        val_batches=max(1, math.ceil(val_blocks / batch_size)),
        vocab=text.tokenizer.tokens,
        tokenizer=text.tokenizer,
        val_from_data=True,
        example_rows=text.example_rows(),
    )
