"""What every section and key of an experiment definition (the TOML a seed signs) means.

Types and defaults come from the schema (the Structs of :mod:`p2ptrain.core.manifests`,
walked by :func:`experiment_keys`) and allowed choices from its constants; the meaning of
each key, and its range in words, are written here, one :class:`KeyDoc` per key, next to
the schema. ``docs/experiment.md`` (:mod:`p2ptrain.core.experiment_doc`) and ``p2ptrain
experiment template`` (:mod:`p2ptrain.core.experiment_template`) are generated from these
tables, so a key added to the schema without a doc here fails
``tests/unit/core/test_experiment_reference.py``.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from p2ptrain.core import manifests as m
from p2ptrain.core.field_rules import MAX_NAME_CHARS

__all__ = [
    "KEYS",
    "SECTIONS",
    "Key",
    "KeyDoc",
    "SectionDoc",
    "TomlValue",
    "experiment_keys",
    "schema_paths",
    "toml_key",
    "toml_value",
]

TomlValue = str | int | float | bool | list[Any] | dict[str, Any]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

_NAME = f"1-{MAX_NAME_CHARS} letters, digits, `.`, `_` or `-`, starting with a letter or digit"
_HEX_ID = "64 lowercase hex characters (a SHA-256)"
_CONFIG = (
    f"at most {m.MAX_CONFIG_ENTRIES} keys named like names; booleans, integers, finite "
    "numbers or strings of at most 256 characters"
)


@dataclass(frozen=True)
class KeyDoc:
    """One key's documentation; its type and default come from the schema."""

    meaning: str
    #: The allowed values in words, beyond the type (ranges, forms).
    values: str = ""
    #: The allowed values, from the schema's constants.
    choices: tuple[str, ...] = ()
    #: Inclusive numeric bounds as the schema checks them (``None``: no upper bound); the
    #: tests check the schema accepts both ends and refuses just beyond.
    bounds: tuple[float, float | None] | None = None
    #: What ``p2ptrain seed`` fills in when the file leaves the key out.
    seed_fills: str = ""
    #: A value for the starting file: written for a required key, shown (commented out)
    #: for a key without a default.
    example: TomlValue | None = None
    #: False for a key that must not appear in the file.
    written: bool = True
    #: The default as a reader should see it, where the schema's stands for it (an empty
    #: ``kind`` that becomes ``indexed``); the tests check both give the same manifest.
    default: TomlValue | None = None


@dataclass(frozen=True)
class SectionDoc:
    """A table of the file: its header as written and what it is for."""

    header: str
    meaning: str
    #: What ``p2ptrain seed`` fills in when the file leaves the whole table out.
    seed_fills: str = ""
    #: Not part of the signed manifest: read by the commands that take a definition.
    definition_only: bool = False


_WITH_SEED = "`p2ptrain seed` and `p2ptrain demo`"

SECTIONS: dict[str, SectionDoc] = {
    "": SectionDoc(
        "top level",
        "Keys before the first table: what the experiment is called, who certifies it, and "
        "how much each trainer trains per window.",
    ),
    "workload": SectionDoc(
        "[workload]",
        "What is trained: the workload every peer builds from this table (a built-in or "
        "installed workload's name, or a reference to your code) and its settings.",
    ),
    "dataset": SectionDoc(
        "[dataset]",
        "The training data, as the shards leases are drawn from. Leave it out for "
        f"{_WITH_SEED}; `p2ptrain experiment create` needs it written out.",
        seed_fills="the workload's dataset, or the prepared dataset that `[data]` names",
    ),
    "dataset.shards": SectionDoc(
        "[[dataset.shards]]",
        f"One table per shard: 1 to {m.MAX_SHARDS:,} shards with distinct names, in ascending "
        "order of name.",
        seed_fills="with `[dataset]`",
    ),
    "dataset.validation": SectionDoc(
        "[[dataset.validation]]",
        "Held-out shards of a `sharded` dataset, one table each as in `[[dataset.shards]]`: "
        "no lease names them; the built-in workloads validate on them. Optional; their "
        "names differ from the training shards', in ascending order.",
        seed_fills="with `[dataset]`",
    ),
    "dataset.tokenizer": SectionDoc(
        "[dataset.tokenizer]",
        "How a text dataset's rows of token ids were made (`p2ptrain data prepare "
        "--tokenizer`), so that every peer builds a model of the right vocabulary and an "
        "export can decode ids. Optional.",
        seed_fills="with `[dataset]`",
    ),
    "data": SectionDoc(
        "[data]",
        f"Where {_WITH_SEED} (and `p2ptrain experiment coverage`) take the dataset from when "
        "it is not the workload's own. Not part of the signed manifest: the dataset it names "
        "is signed as `[dataset]`. `p2ptrain experiment create` does not read it.",
        definition_only=True,
    ),
    "inner_optimizer": SectionDoc(
        "[inner_optimizer]",
        "The trainers' inner optimizer and the schedule of its learning rate over the run. "
        "A trainer runs the optimizer its workload builds (`char-gpt` and `hf-causal-lm` "
        "take `lr` from `[workload.config]`): `name`, `lr` and `config` record it for "
        "readers of the manifest, while every trainer applies the schedule to the rates the "
        "workload built.",
    ),
    "outer_optimizer": SectionDoc(
        "[outer_optimizer]",
        "The step applied to each window's aggregate pseudo-gradient, bit-exact on every "
        "validator (DiLoCo: Nesterov, lr 0.7, momentum 0.9).",
    ),
    "window": SectionDoc(
        "[window]",
        "How a window runs: how long it waits for updates, how many it needs and takes, and "
        "how far an update may lag behind the chain.",
    ),
    "codec": SectionDoc(
        "[codec]",
        "How trainers encode their updates (pseudo-gradients) for upload "
        "(docs/protocol.md §9, update codecs).",
    ),
    "aggregation": SectionDoc(
        "[aggregation]",
        "How a window's screened updates are combined, and the precision of the aggregate "
        "(docs/protocol.md §9).",
    ),
    "screening": SectionDoc(
        "[screening]",
        "Which updates enter the aggregate, and the quarantine of trainers whose updates "
        "are rejected.",
    ),
}

#: The keys read from a definition that the manifest does not hold, with their TOML type.
DEFINITION_ONLY: dict[str, str] = {"data.prepared": "string"}

KEYS: dict[str, KeyDoc] = {
    "network_id": KeyDoc(
        "The id of the network this experiment runs on (its network manifest's id).",
        values=_HEX_ID,
        seed_fills="the id of the network it creates",
    ),
    "study": KeyDoc(
        "The line of work this experiment belongs to; its revisions share it.",
        values=_NAME,
        example="my-study",
    ),
    "name": KeyDoc(
        "This experiment's name within its study, shown by `p2ptrain status`, the "
        "dashboard and exports.",
        values=_NAME,
        example="run-1",
    ),
    "revision": KeyDoc(
        "1 for a new experiment; a later revision of it (2, 3, ...) names its `parent` and "
        "`start_head`.",
        values="at least 1",
        bounds=(1, None),
    ),
    "parent": KeyDoc(
        "The experiment id of the revision this one follows: set together with "
        "`start_head`, never on revision 1. Recorded in the manifest; a node starts from "
        "`genesis_weights` either way.",
        values=_HEX_ID,
        example="<the parent experiment's id>",
    ),
    "start_head": KeyDoc(
        "The head (of the parent's chain) this revision starts from: set together with `parent`.",
        values=_HEX_ID,
        example="<a head id of the parent>",
    ),
    "authority": KeyDoc(
        "The key that signs the manifest. Never written in the file: the key of the data "
        "directory that signs it (the seed's, or `p2ptrain experiment create --dir`'s) is "
        "the authority.",
        written=False,
    ),
    "protocol": KeyDoc(
        "`diloco`: each trainer takes `inner_steps` local steps, then the outer optimizer "
        "steps on the aggregate of their pseudo-gradients. `fedavg`: federated averaging, "
        "which needs `[outer_optimizer]` name `sgd`, lr 1.0 and momentum 0.",
        choices=m.TRAINING_PROTOCOLS,
    ),
    "inner_steps": KeyDoc(
        "H: the optimizer steps each trainer takes on its lease in a window before it sends "
        "its update.",
        values="1 to 1,000,000",
        bounds=(1, 1_000_000),
    ),
    "validators": KeyDoc(
        "The validators' Ed25519 public keys as hex, in any order: they recompute each "
        "window's proposal and sign the heads they agree with. `p2ptrain init --dir DIR` "
        "prints a node's key; `p2ptrain demo` puts in its own validators.",
        values=f"1 to {m.MAX_VALIDATORS} distinct keys of 64 hex characters",
        example=["0" * 64],
    ),
    "quorum": KeyDoc(
        "How many validators' signatures certify a head. Make it a majority, so that any "
        "two quorums share a validator: `p2ptrain seed`, `p2ptrain experiment create`, "
        "`p2ptrain sim` and the Python API (`NodeSettings`) refuse less unless given "
        "`--allow-minority-quorum` (`allow_minority_quorum=True`).",
        values="1 to the number of validators",
        example=1,
    ),
    "lease_size": KeyDoc(
        "The samples each trainer trains on in a window (its lease of the dataset).",
        values="1 to the dataset's samples",
        seed_fills="`inner_steps` x the workload's batch size, so that a window sees each "
        "leased sample once",
    ),
    "genesis_weights": KeyDoc(
        "The blob id of the initial weights every peer starts from.",
        values=_HEX_ID,
        seed_fills="the hash of the workload's initial weights, which it stores and serves",
    ),
    "reducers": KeyDoc(
        "The reducers' public keys as hex, in any order: they propose each window's "
        "aggregate first, in rendezvous order, before the validators fall back to "
        "proposing themselves. Every participant must agree on them.",
        values=f"0 to {m.MAX_VALIDATORS} distinct keys of 64 hex characters",
    ),
    "workload.name": KeyDoc(
        "The workload: `char-gpt` or `hf-causal-lm` (built in), or the name an installed "
        "package gives its workload (entry point group `p2ptrain.workloads`). The seed "
        "also takes a reference here, as in `reference`.",
        values=_NAME,
        seed_fills="a name made from `reference` when only that is given "
        "(`examples/hf_gpt2/workload.py:workload` becomes `hf_gpt2.workload`)",
    ),
    "workload.schema_hash": KeyDoc(
        "The hash of the model's schema (parameter names, shapes, dtypes): a node whose "
        "model differs is refused.",
        values=_HEX_ID,
        seed_fills="the hash of the workload's initial weights' schema",
    ),
    "workload.config": KeyDoc(
        "The workload's settings, passed to its factory (`factory(config)`); the built-in "
        "workloads' settings are listed below.",
        values=_CONFIG,
        example={},
    ),
    "workload.reference": KeyDoc(
        "Your workload's code: `path/to/file.py:factory` (relative to where the node runs) "
        "or `package.module:factory`. A hint for operators: a node runs it only when its "
        "operator passes the same code with `--workload`, never because a manifest names it.",
        values="at most 256 characters",
        example="path/to/file.py:factory",
    ),
    "workload.config_hash": KeyDoc(
        "The hash of `config` and the model's own configuration (a Hugging Face `config`): "
        "a node whose model is configured differently can say so.",
        values=f"empty, or {_HEX_ID}",
        seed_fills="the hash of the config and of the model the workload built",
    ),
    "workload.batch_size": KeyDoc(
        "Samples per inner step, which a trainer must use (0: not recorded).",
        values="0 to 16,777,216",
        bounds=(0, 1 << 24),
        seed_fills="the workload's batch size",
    ),
    "dataset.name": KeyDoc("The dataset's name.", values=_NAME),
    "dataset.kind": KeyDoc(
        "How trainers get a lease's samples: `indexed`, from a map-style dataset every "
        "trainer holds; `sharded`, from prepared shard files fetched from peers by hash "
        "(docs/data.md); `generated`, made from the lease, no data moves; `custom`, from "
        "a callback of the user.",
        choices=m.DATA_KINDS,
        default="indexed",
    ),
    "dataset.shards.name": KeyDoc("The shard's name.", values=_NAME),
    "dataset.shards.blob_id": KeyDoc(
        "For a `sharded` dataset, the hash of the shard file (the blob peers fetch); for "
        "the other kinds, a hash of the shard's samples or of what generates them.",
        values=_HEX_ID,
    ),
    "dataset.shards.samples": KeyDoc(
        "The samples in the shard.", values="at least 1", bounds=(1, None)
    ),
    "dataset.shards.bytes": KeyDoc(
        "The shard file's size in bytes: at least 1 in a `sharded` dataset, 0 in the others.",
        values=f"0 to {m.MAX_SHARD_BYTES:,} (1 GiB)",
        bounds=(0, m.MAX_SHARD_BYTES),
    ),
    "dataset.tokenizer.kind": KeyDoc(
        "`bytes`: UTF-8 bytes, 256 ids; `chars`: `vocab` holds the character of each id; "
        "`huggingface`: a tokenizer of class `name`.",
        choices=m.TOKENIZER_KINDS,
    ),
    "dataset.tokenizer.vocab_size": KeyDoc(
        "The number of token ids: 256 for `bytes`, the length of `vocab` for `chars`.",
        values=f"1 to {m.MAX_VOCAB_SIZE:,}",
        bounds=(1, m.MAX_VOCAB_SIZE),
    ),
    "dataset.tokenizer.block_size": KeyDoc(
        "Tokens per row.", values="1 to 16,777,216", bounds=(1, 1 << 24)
    ),
    "dataset.tokenizer.vocab": KeyDoc(
        "For `chars` only: the character of each id, in id order (the sorted distinct "
        "characters of the corpus).",
        values="`vocab_size` distinct characters in code point order",
    ),
    "dataset.tokenizer.name": KeyDoc(
        "For `huggingface`: the tokenizer's class name.", values="at most 128 characters"
    ),
    "data.prepared": KeyDoc(
        "A directory written by `p2ptrain data prepare`, relative to this file's directory: "
        "the seed signs its shards as `[dataset]` (kind `sharded`) and serves them. The only "
        "key of `[data]`.",
        values="a directory path",
        example="prepared",
    ),
    "inner_optimizer.name": KeyDoc(
        "The inner optimizer's name, as recorded.", choices=m.INNER_OPTIMIZERS
    ),
    "inner_optimizer.lr": KeyDoc(
        "Its learning rate, as recorded.", values="0 to 10", bounds=(0.0, 10.0)
    ),
    "inner_optimizer.config": KeyDoc(
        "Its other settings, as recorded.", values=_CONFIG, example={"weight_decay": 0.1}
    ),
    "inner_optimizer.schedule": KeyDoc(
        "How the learning rate changes from window to window, as a factor on the rates the "
        "workload built: after the warm-up, `constant` keeps 1; `cosine` goes from 1 down "
        "to `min_lr_ratio` over `decay_windows` windows, then stays there (the DiLoCo "
        "recipe). A workload without `set_lr_scale` cannot train a scheduled experiment: "
        "its trainer refuses to start and says so.",
        choices=m.INNER_SCHEDULES,
    ),
    "inner_optimizer.warmup_windows": KeyDoc(
        "Windows of linear warm-up: window w trains at w / `warmup_windows` of the rate (0: none).",
        values="0 to 1,000,000",
        bounds=(0, 1_000_000),
    ),
    "inner_optimizer.decay_windows": KeyDoc(
        "Windows the cosine decay lasts after the warm-up: at least 1 for `cosine` (the "
        "windows the run is planned to last); unused by `constant`.",
        values="0 to 1,000,000",
        bounds=(0, 1_000_000),
    ),
    "inner_optimizer.min_lr_ratio": KeyDoc(
        "The factor the cosine schedule ends at.", values="0 to 1", bounds=(0.0, 1.0)
    ),
    "outer_optimizer.name": KeyDoc(
        "`nesterov` (momentum, as `torch.optim.SGD(nesterov=True)`) or `sgd` (plain, momentum 0).",
        choices=m.OUTER_OPTIMIZERS,
    ),
    "outer_optimizer.lr": KeyDoc("The outer learning rate.", values="0 to 10", bounds=(0.0, 10.0)),
    "outer_optimizer.momentum": KeyDoc(
        "The Nesterov momentum; 0 for `sgd`.", values="0 to 0.999", bounds=(0.0, 0.999)
    ),
    "window.deadline_s": KeyDoc(
        "Seconds a window waits for trainers' updates after its first update arrived (a "
        "slow start or download costs nobody a window); it closes earlier once "
        "`max_updates` updates arrived, and a window that holds no update this long after "
        "it opened asks its peers what they hold. Leave room for a slow trainer's whole "
        "window: an instant update starts the clock.",
        values="0.01 to 86,400",
        bounds=(0.01, 86400.0),
    ),
    "window.min_updates": KeyDoc(
        "The updates that must pass screening for the window to certify a head; with fewer "
        "the window certifies none and the chain stays where it was.",
        values="1 to 1,000,000",
        bounds=(1, 1_000_000),
    ),
    "window.max_updates": KeyDoc(
        "The most updates a window takes, the first to arrive: it closes as soon as this "
        "many arrived.",
        values="`min_updates` to 1,000,000",
    ),
    "window.proposal_s": KeyDoc(
        "Each proposer's slot after the deadline, in seconds: the ranked reducers, then the "
        "ranked validators falling back, each get this long before the next one proposes.",
        values="0.01 to 86,400",
        bounds=(0.01, 86400.0),
    ),
    "window.staleness": KeyDoc(
        "How many heads an update may lag: with 0 an update of window w builds on the head "
        "at height w - 1; with 1 trainers train window w + 1 while window w is being "
        "certified (busier trainers, outer steps one window late).",
        values=f"0 to {m.MAX_STALENESS}",
        bounds=(0, m.MAX_STALENESS),
    ),
    "codec.name": KeyDoc(
        "The update codec: `fp32`, `fp16` and `bf16` cast; `int8`, `int4` and `int2` "
        "quantise blockwise; `topk`, `lowrank` and `sparseloco` keep part of the update "
        "and carry the rest over to the next one (error feedback).",
        choices=m.UPDATE_CODECS,
    ),
    "codec.config": KeyDoc(
        "The codec's settings: `block_size` (`int8`, `int4`, `int2`; default 256), "
        "`fraction` (`topk`, default 0.01; `sparseloco`, default 0.02), `rank` (`lowrank`, "
        "default 4); `sparseloco` also takes `bits` (2 or 4, default 2), `chunk` (top-k "
        "within chunks of this many values, default 4096; 0 the whole tensor), "
        "`dense_vectors` (1, the default: norms and biases go as `int8`), `error_decay` "
        "(default 0.95) and `dense_windows` (the first windows go as `int4`, and their "
        "aggregate too, default 0); "
        "it is meant for outer `sgd` at lr 1, the `contributor_mean` rule and `int4` "
        "aggregates (stored sparse).",
        values=_CONFIG,
        example={"block_size": 256},
    ),
    "aggregation.rule": KeyDoc(
        "The robust aggregation rule, applied after screening.", choices=m.AGGREGATION_RULES
    ),
    "aggregation.config": KeyDoc(
        "The rule's settings: `beta` (`trimmed_mean`: the fraction trimmed from each side, "
        "default 0.3), `f` and `m` (`krum`), `tau` and `iterations` (`centered_clip`), "
        "`iterations`, `eps` and `tolerance` (`geometric_median`), `clip` (`contributor_mean`: "
        "1, the default, clips each update to the median norm); a key the rule does not "
        "know is refused.",
        values=_CONFIG,
        example={"beta": 0.3},
    ),
    "aggregation.precision": KeyDoc(
        "How the aggregate is rounded before the outer step and stored for followers: "
        "`fp32`, not at all; `bf16`, to bfloat16 (half the bytes; a sparse aggregate is "
        "stored sparse); `int8`, `int4`, `int2`, blockwise (a quarter, an eighth, a "
        "sixteenth of the bytes to download; a sparse aggregate is stored sparse, its "
        "stored values rounded).",
        choices=m.AGGREGATE_PRECISIONS,
    ),
    "screening.max_norm_ratio": KeyDoc(
        "An update's L2 norm must lie within this factor of the median norm of the "
        "window's updates (above or below).",
        values="1 to 1,000,000",
        bounds=(1.0, 1e6),
    ),
    "screening.min_cosine": KeyDoc(
        "The least cosine similarity an update must have to the coordinate-wise median of "
        "the updates that passed the norm test.",
        values="-1 to 1",
        bounds=(-1.0, 1.0),
    ),
    "screening.quarantine_after": KeyDoc(
        "Rejected updates in a row after which a trainer is excluded.",
        values="1 to 1,000",
        bounds=(1, 1000),
    ),
    "screening.quarantine_windows": KeyDoc(
        "The windows a first exclusion lasts; each repeat offence doubles it (at most "
        "10,000 windows).",
        values="1 to 1,000,000",
        bounds=(1, 1_000_000),
    ),
}

# A validation shard is described as a training shard is; it is always a shard file.
KEYS.update(
    {
        f"dataset.validation.{leaf}": KEYS[f"dataset.shards.{leaf}"]
        for leaf in ("name", "blob_id", "samples")
    }
)
KEYS["dataset.validation.bytes"] = KeyDoc(
    "The shard file's size in bytes.",
    values=f"1 to {m.MAX_SHARD_BYTES:,} (1 GiB)",
    bounds=(1, m.MAX_SHARD_BYTES),
)


@dataclass(frozen=True)
class Key:
    """One key of the file: where it is, its TOML type and default, and its doc."""

    #: The table it belongs to (``""``: top level; ``"dataset.shards"``).
    section: str
    name: str
    toml_type: str
    #: The schema's default; ``None`` with ``has_default`` means "not set".
    default: TomlValue | None
    has_default: bool
    doc: KeyDoc

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def seed_fills(self) -> str:
        """What the seed fills in when the file leaves the key (or its table) out."""
        return self.doc.seed_fills or SECTIONS[self.section].seed_fills

    @property
    def required(self) -> bool:
        """Whether a file for the seed must give it."""
        return not self.has_default and not self.seed_fills and self.doc.written


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def _struct_of(annotation: Any) -> type[msgspec.Struct] | None:
    """The Struct a field holds as a table (alone, optional, or an array of tables), or
    None for a plain value."""
    if _is_struct(annotation):
        return typing.cast(type[msgspec.Struct], annotation)
    structs = [a for a in typing.get_args(annotation) if _is_struct(a)]
    return structs[0] if structs else None


def _fields(
    struct: type[msgspec.Struct], section: str
) -> Iterator[tuple[str, msgspec.structs.FieldInfo]]:
    """The schema's plain fields with their sections, top level first, then each table
    (and the tables within it) in the schema's order."""
    nested: list[tuple[type[msgspec.Struct], str]] = []
    for field in msgspec.structs.fields(struct):
        inner = _struct_of(field.type)
        if inner is None:
            yield section, field
        else:
            nested.append((inner, f"{section}.{field.name}" if section else field.name))
    for inner_struct, inner_section in nested:
        yield from _fields(inner_struct, inner_section)


def schema_paths() -> tuple[str, ...]:
    """Every key of the schema and of the definition only, as dotted paths."""
    from_schema = (
        f"{section}.{field.name}" if section else field.name
        for section, field in _fields(m.ExperimentManifest, "")
    )
    return (*from_schema, *DEFINITION_ONLY)


def _toml_type(annotation: Any) -> str:
    if annotation is str:
        return "string"
    if annotation is bool:
        return "boolean"
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if annotation is bytes:
        return "hex string"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple and args[0] is bytes:
        return "array of hex strings"
    if origin is dict:
        return "table"
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (kind,) = (a for a in args if a is not type(None))
        return _toml_type(kind)
    raise TypeError(f"no TOML type for the schema's {annotation!r}: add one to _toml_type")


def _key(section: str, field: msgspec.structs.FieldInfo) -> Key:
    path = f"{section}.{field.name}" if section else field.name
    doc = KEYS.get(path)
    if doc is None:
        raise KeyError(
            f"the experiment key {path} has no KeyDoc: document it in experiment_reference.KEYS"
        )
    if field.default is not msgspec.NODEFAULT:
        has_default, default = True, field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        has_default, default = True, field.default_factory()
    else:
        has_default, default = False, None
    if isinstance(default, tuple):
        default = list(default)
    if doc.default is not None:
        default = doc.default
    return Key(section, field.name, _toml_type(field.type), default, has_default, doc)


def experiment_keys() -> tuple[Key, ...]:
    """Every key of an experiment definition, in the order of the file: the tables in the
    order of :data:`SECTIONS`, the keys of each in the schema's order."""
    keys = [_key(section, field) for section, field in _fields(m.ExperimentManifest, "")]
    for path, toml_type in DEFINITION_ONLY.items():
        section, _, name = path.rpartition(".")
        keys.append(Key(section, name, toml_type, None, True, KEYS[path]))
    order = list(SECTIONS)
    return tuple(sorted(keys, key=lambda key: order.index(key.section)))


def toml_value(value: TomlValue) -> str:
    """``value`` as TOML writes it (arrays and tables inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML has no finite form of {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if not value:
        return "{}"
    return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"


def toml_key(name: str) -> str:
    """``name`` as a TOML key: bare when it can be, else quoted."""
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name, ensure_ascii=False)
