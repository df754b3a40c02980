"""A small character-level GPT on Shakespeare: the demo's workload.

The model is a standard pre-LayerNorm decoder-only transformer (token and learned position
embeddings, causal self-attention through ``scaled_dot_product_attention``, a 4x MLP, a final
LayerNorm and a tied or untied head), small enough that four trainers and two validators
share a laptop's CPU. Its initial weights depend only on the config (``seed`` included), so
every peer derives the same genesis weights from the experiment manifest's workload config.

:data:`DEFAULT_CONFIG` and :data:`DEMO_DEFAULTS` were chosen with ``bench/tune_diloco.py``,
which simulates the network's math in-process (real leases, int8 codec, trimmed-mean
aggregation and outer Nesterov step) and compares against synchronous data parallel training
(DDP) on the same samples. With these defaults (238k parameters, 4 trainers, 16 windows of
50 inner steps, one CPU thread) it measured, for model seeds 0 and 1: validation loss 1.980
and 2.007 against DDP's 1.916 and 1.932 (ratio 1.034 and 1.039), 27 ms per inner step,
about 86 s of trainer compute plus 86 s for the DDP replay, and 287x fewer bytes sent per
trainer than a ring all-reduce of fp32 gradients. The DiLoCo paper's outer settings (lr 0.7,
momentum 0.9, tuned for hundreds of windows) did worse over 16 windows than lr 1.0 with
momentum 0.5 (ratio 1.053 against 1.041 on a 110k-parameter model); a higher or lower inner
lr (2e-3, 5e-3) did too. The demo runs 24 windows, where the gap is smaller still (1.896
against 1.853, ratio 1.024, 287x fewer bytes). With the cosine inner schedule and int4
codes that DDP replays on the same samples too, 24 windows end at 1.887 against 1.807 (ratio
1.045): the schedule helped DDP more. Outer lr 0.7 to 1.3, momentum 0.5 to 0.9, inner lr 2e-3
to 5e-3, the mean instead of the trimmed mean, int8 rounding, staleness or an inner warm-up
over 2 or 4 windows do not close that gap; more windows of 50 steps do not either (32: ratio
1.044). Shorter windows do, at the same samples: H = 25 over 48 windows 1.030, H = 20 over
60 windows 1.026 (docs/benchmarks.md). So the demo runs 60 windows of 20 steps (`make demo`:
1.8483 against 1.8121, ratio 1.020), for 2.5 times the bytes of H = 50 (205x fewer than DDP
by formula, against 499x).

Larger models need more windows to come as close: with 16 windows, 416k parameters (2 x 128)
measured a ratio of 1.061 (1.043 at 24 windows) and 808k (4 x 128, context 32) 1.14, also
with H = 20 and 40 windows (1.13) or the paper's outer settings (1.21). The demo keeps the
238k model so that it stays within 5% of DDP in about five minutes on two cores; the
``n_layer``/``n_embd`` settings scale it for machines with more time.

When the experiment names prepared text (``[data] prepared``), the model's vocabulary is
that dataset's, its context (``block_size``) is one less than the rows' length (the targets
are the ids shifted by one; another ``block_size`` is refused), it trains on the prepared
rows and validates on the dataset's validation split only
(:mod:`p2ptrain.torch.prepared_text`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn

from p2ptrain.core.manifests import DatasetManifest
from p2ptrain.data.shakespeare import ShakespeareChars
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import PairLoss, cross_entropy_loss
from p2ptrain.torch.demo_settings import DEMO_AGGREGATE_PRECISION, DEMO_CODEC, DEMO_DEFAULTS
from p2ptrain.torch.prepared_text import PreparedText, prepared_text
from p2ptrain.torch.workload import TorchWorkload

__all__ = [
    "DEFAULT_CONFIG",
    "DEMO_AGGREGATE_PRECISION",
    "DEMO_CODEC",
    "DEMO_DEFAULTS",
    "CharGPT",
    "char_gpt_workload",
    "demo_inner_schedule",
]

ConfigValue = str | int | float | bool

#: The workload's settings (keys of an experiment manifest's ``workload.config``).
DEFAULT_CONFIG: Final[dict[str, ConfigValue]] = {
    "n_layer": 2,
    "n_embd": 96,
    "n_head": 4,
    "block_size": 64,
    "tie_weights": True,
    "seed": 0,
    "lr": 3e-3,
    "beta1": 0.9,
    "beta2": 0.95,
    "weight_decay": 0.1,
    "batch_size": 16,
    "samples_per_shard": 256,
    "spread_blocks": True,
    "val_blocks": 256,
}


def demo_inner_schedule(windows: int) -> dict[str, str | int | float]:
    """The demo's ``[inner_optimizer]`` schedule keys for a run of ``windows`` windows."""
    return {
        "schedule": "cosine",
        "decay_windows": max(1, windows),
        "min_lr_ratio": float(DEMO_DEFAULTS["min_lr_ratio"]),
    }


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        shape = (batch, length, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        hidden: torch.Tensor = self.fc(self.ln_2(x))
        out: torch.Tensor = x + self.fc_proj(nn.functional.gelu(hidden))
        return out


class CharGPT(nn.Module):
    """Logits ``[B, T, vocab_size]`` for token ids ``[B, T]`` (``T <= block_size``)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        n_layer: int,
        n_embd: int,
        n_head: int,
        block_size: int,
        tie_weights: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise LocalError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.token.weight
        self._initialise(seed, n_layer)

    def _initialise(self, seed: int, n_layer: int) -> None:
        """GPT-2's scheme from a private generator: N(0, 0.02) weights, residual projections
        scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorms. No global RNG is used."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias") or ".ln_" in name or name.startswith("ln_"):
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    std = 0.02
                    if name.endswith(("proj.weight", "fc_proj.weight")):
                        std /= math.sqrt(2 * n_layer)
                    param.normal_(0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.block_size:
            raise LocalError(f"sequence of {length} tokens exceeds block_size {self.block_size}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _settings(config: Mapping[str, ConfigValue]) -> dict[str, ConfigValue]:
    unknown = sorted(config.keys() - DEFAULT_CONFIG.keys())
    if unknown:
        raise LocalError(
            f"char-gpt does not know the settings {unknown}; known: {sorted(DEFAULT_CONFIG)}"
        )
    settings = dict(DEFAULT_CONFIG)
    for key, given in config.items():
        default = DEFAULT_CONFIG[key]
        if isinstance(default, bool) or isinstance(given, bool):
            ok = isinstance(given, bool) and isinstance(default, bool)
        elif isinstance(default, float):
            ok = isinstance(given, int | float)
        else:
            ok = isinstance(given, type(default))
        if not ok:
            raise LocalError(
                f"char-gpt setting {key!r} must be of type {type(default).__name__}, got {given!r}"
            )
        settings[key] = float(given) if isinstance(default, float) else given
    return settings


def _int(settings: Mapping[str, ConfigValue], key: str, low: int = 1) -> int:
    value = settings[key]
    assert isinstance(value, int)
    if value < low:
        raise LocalError(f"char-gpt setting {key!r} must be at least {low}, got {value}")
    return value


def _float(settings: Mapping[str, ConfigValue], key: str) -> float:
    value = settings[key]
    assert isinstance(value, float)
    if not math.isfinite(value) or value < 0:
        raise LocalError(f"char-gpt setting {key!r} must be a finite number >= 0, got {value}")
    return value


_PAIR_LOSS = PairLoss(cross_entropy_loss)


def char_gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``(inputs, targets)`` batches (the Shakespeare splits), or of rows of
    ``block_size + 1`` token ids (``{"input_ids": ...}`` rows of a prepared dataset, or
    1-D tensors), whose targets are the ids shifted by one."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise LocalError(
                f"char-gpt trains on (inputs, targets) pairs or on 'input_ids' rows; the batch "
                f"has {sorted(batch)[:6]}"
            )
        ids = batch["input_ids"]
    elif isinstance(batch, torch.Tensor):
        ids = batch
    else:
        return _PAIR_LOSS(model, batch)
    ids = ids.long()
    return cross_entropy_loss(model(ids[:, :-1]), ids[:, 1:])


def _context(config: Mapping[str, ConfigValue], text: PreparedText) -> int:
    """The model's context on prepared rows: one less than their length."""
    rows = text.tokenizer.block_size
    given = config.get("block_size")
    name = text.dataset.name
    if rows < 2:
        raise LocalError(
            f"char-gpt: the prepared dataset {name!r} has rows of 1 token, which leave no "
            "context (the targets are the ids shifted by one): prepare it with --block-size "
            "2 or more"
        )
    if given is not None and given != rows - 1:
        redo = given + 1 if isinstance(given, int) and not isinstance(given, bool) else "L"
        raise LocalError(
            f"char-gpt: block_size = {given!r:.20}, but the prepared dataset {name!r} has rows "
            f"of {rows} tokens, which give a context of {rows - 1} (the targets are the ids "
            "shifted by one): leave block_size out, or prepare the data again with "
            f"--block-size {redo}"
        )
    return rows - 1


def char_gpt_workload(
    config: Mapping[str, ConfigValue], *, dataset: DatasetManifest | None = None
) -> TorchWorkload:
    """The char-GPT workload for ``config`` (missing keys take :data:`DEFAULT_CONFIG`):
    the model, AdamW (weight decay on matrices only) and the Shakespeare splits, or the
    experiment's prepared text when ``dataset`` (its dataset manifest) is a prepared one."""
    settings = _settings(config)
    text = prepared_text(dataset, "char-gpt", dict(config))
    vocab: tuple[str, ...] | None
    if text is None:
        block_size = _int(settings, "block_size")
        spread = bool(settings["spread_blocks"])
        train = ShakespeareChars(block_size, "train", spread=spread)
        val = ShakespeareChars(block_size, "val")
        vocab_size, vocab = train.vocab_size, tuple(train.vocab)
    else:
        block_size = _context(config, text)
        vocab_size, vocab = text.tokenizer.vocab_size, text.tokenizer.tokens
    model = CharGPT(
        vocab_size,
        n_layer=_int(settings, "n_layer"),
        n_embd=_int(settings, "n_embd"),
        n_head=_int(settings, "n_head"),
        block_size=block_size,
        tie_weights=bool(settings["tie_weights"]),
        seed=_int(settings, "seed", 0),
    )
    params = list(model.parameters())
    groups: list[dict[str, Any]] = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups,
        lr=_float(settings, "lr"),
        betas=(_float(settings, "beta1"), _float(settings, "beta2")),
        weight_decay=_float(settings, "weight_decay"),
    )
    batch_size = _int(settings, "batch_size")
    available = len(val) if text is None else max(1, text.dataset.validation_samples)
    val_blocks = min(_int(settings, "val_blocks"), available)
    eval_batch_size = min(val_blocks, 512)  # beyond 512, val_blocks rounds up to 512s
    workload = TorchWorkload(
        model,
        optimizer,
        train if text is None else text.pipeline,
        val if text is None else None,
        batch_size=batch_size,
        samples_per_shard=_int(settings, "samples_per_shard"),
        name=f"shakespeare-chars-{block_size}" if text is None else text.dataset.name,
        val_batches=math.ceil(val_blocks / eval_batch_size),
        eval_batch_size=eval_batch_size,
        batch_loss=char_gpt_loss,
        language_model=True,
        vocab=vocab,
        tokenizer=None if text is None else text.tokenizer,
        val_from_data=text is not None,
        example_rows=None if text is None else text.example_rows(),
    )
    workload.language_model = True  # next-character cross-entropy: perplexity = exp(loss)
    return workload
