"""The settings (``[workload.config]``) of the built-in workloads, documented without
importing them.

The workloads themselves live in :mod:`p2ptrain.torch` and need torch; ``docs/experiment.md``
and ``p2ptrain experiment template`` describe their settings from this table instead.
``tests/unit/core/test_experiment_reference.py`` checks it against the workloads' own
``DEFAULT_CONFIG``, so a setting added there without a line here fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BUILT_IN_WORKLOADS", "BuiltInWorkload", "Setting"]

ConfigValue = str | int | float | bool


@dataclass(frozen=True)
class Setting:
    """One key of a workload's ``[workload.config]``."""

    meaning: str
    #: The value the workload takes when the key is left out (None: no default).
    default: ConfigValue | None = None


@dataclass(frozen=True)
class BuiltInWorkload:
    summary: str
    settings: dict[str, Setting]
    #: The settings a starting file writes out; the others are shown commented out.
    start: dict[str, ConfigValue] = field(default_factory=dict)


_SEED = "The seed of the initial weights: every peer derives the same genesis weights."
_SHARD = "Samples in each shard of the dataset's manifest (leases are drawn from shards)."
_VAL = "Validation rows an evaluation reads."

BUILT_IN_WORKLOADS: dict[str, BuiltInWorkload] = {
    "char-gpt": BuiltInWorkload(
        "A small character-level GPT on Shakespeare's plays: the demo's model, trained with "
        "AdamW (weight decay on matrices only). Every setting has a default.",
        {
            "n_layer": Setting("Transformer blocks.", 2),
            "n_embd": Setting("The model's width (embedding size).", 96),
            "n_head": Setting("Attention heads; they divide `n_embd`.", 4),
            "block_size": Setting("The context, in characters.", 64),
            "tie_weights": Setting("Whether the output head shares the token embedding.", True),
            "seed": Setting(_SEED, 0),
            "lr": Setting("AdamW's learning rate.", 3e-3),
            "beta1": Setting("AdamW's beta1.", 0.9),
            "beta2": Setting("AdamW's beta2.", 0.95),
            "weight_decay": Setting("AdamW's weight decay.", 0.1),
            "batch_size": Setting("Samples per inner step.", 16),
            "samples_per_shard": Setting(_SHARD, 256),
            "spread_blocks": Setting(
                "Whether the training blocks are numbered in an order spread over the whole "
                "text (every shard, and so every lease, holds blocks from all of the plays, as "
                "uniform minibatches do) rather than in the text's order (a shard is one "
                "stretch of one play). Both order the same blocks; the dataset's hash differs.",
                True,
            ),
            "val_blocks": Setting(_VAL, 256),
        },
    ),
    "hf-causal-lm": BuiltInWorkload(
        "A Hugging Face causal language model (`pip install 'p2ptrain[hf]'`) on the "
        "characters of Shakespeare's plays, trained with AdamW: built from `model_type` and "
        "the size keys of that model type's config (for `gpt2`: `n_layer`, `n_embd`, "
        "`n_head`, `n_positions`; `vocab_size` defaults to the corpus's characters), or "
        "loaded from `pretrained`.",
        {
            "model_type": Setting(
                "A transformers model type (`gpt2`, `llama`, ...); give its size keys beside "
                "it, as keys of this table."
            ),
            "pretrained": Setting(
                "Instead of `model_type`: a local directory holding a pretrained model "
                "(never downloaded: every peer must hold the same files)."
            ),
            "corpus": Setting(
                "The training text; `shakespeare` is the built-in one.", "shakespeare"
            ),
            "block_size": Setting("Tokens per training row.", 64),
            "batch_size": Setting("Samples per inner step.", 16),
            "lr": Setting("AdamW's learning rate.", 3e-3),
            "seed": Setting(_SEED, 0),
            "samples_per_shard": Setting(_SHARD, 256),
            "val_blocks": Setting(_VAL, 256),
            "dtype": Setting("The model's dtype: `float32`, `bfloat16` or `float16`.", "float32"),
        },
        start={"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64},
    ),
}
