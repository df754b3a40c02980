"""TOML experiment definitions: good files parse, bad ones name the bad field."""

from __future__ import annotations

import pytest

from p2ptrain.core.experiment_config import experiment_from_toml
from p2ptrain.errors import LocalError
from tests.support.builders import h, identity

VALIDATORS = [identity(i) for i in range(3)]
AUTHORITY = identity(50)

GOOD = f"""
network_id = "{h("net")}"
study = "shakespeare"
name = "char-gpt"
quorum = 2
lease_size = 256
inner_steps = 50
genesis_weights = "{h("genesis")}"
validators = [{", ".join(f'"{v.public_key.hex()}"' for v in reversed(VALIDATORS))}]

[workload]
name = "char-gpt"
schema_hash = "{h("schema")}"
config = {{ d_model = 128, tokenizer = "bytes" }}

[dataset]
name = "tiny-shakespeare"
[[dataset.shards]]
name = "shard-000"
blob_id = "{h("s0")}"
samples = 1000
[[dataset.shards]]
name = "shard-001"
blob_id = "{h("s1")}"
samples = 1000

[outer_optimizer]
lr = 0.7
momentum = 0.9

[window]
deadline_s = 60
min_updates = 2
max_updates = 10
"""


def test_a_good_definition_parses_with_defaults_and_sorted_validators() -> None:
    manifest = experiment_from_toml(GOOD, AUTHORITY.public_key)
    assert manifest.authority == AUTHORITY.public_key
    assert list(manifest.validators) == sorted(v.public_key for v in VALIDATORS)
    assert manifest.window.deadline_s == 60.0
    assert manifest.codec.name == "int8"
    assert manifest.aggregation.rule == "trimmed_mean"
    assert manifest.workload.config == {"d_model": 128, "tokenizer": "bytes"}
    assert manifest.dataset.total_samples == 2000
    # the same definition always gives the same id
    assert manifest.id == experiment_from_toml(GOOD, AUTHORITY.public_key).id


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("min_updates = 2", "min_updates = 0", "window.min_updates: must be between 1"),
        ("quorum = 2", "quorum = 5", "quorum: must be between 1 and 3"),
        ("quorum = 2", 'quorum = "two"', "quorum: Expected `int`, got `str`"),
        ("samples = 1000\n[[", "samples = -1\n[[", "dataset.shards[0].samples: must be"),
        ("d_model = 128", "d_model = nan", "workload.config.d_model: must be a finite"),
        ("[window]", "[window]\ndeadlin_s = 3", "window: Object contains unknown field"),
        ('study = "shakespeare"', 'study = "two words"', "study: must be 1-128 characters"),
        ("lease_size = 256", "lease_size = 5000", "lease_size: must be between 1 and 2000"),
        ('"{}"'.format(h("genesis")), '"xyz"', "genesis_weights: must be 64 lowercase hex"),
        ('study = "shakespeare"', "", "study"),
        ("[outer_optimizer]", '[outer_optimizer]\nname = "adam"', "outer_optimizer.name"),
        ("quorum = 2", "quorum = 2\nauthority = 'me'", "authority: leave it out"),
        ("quorum = 2", "quorum = ", "not valid TOML"),
    ],
)
def test_a_bad_definition_names_the_field(old: str, new: str, message: str) -> None:
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    with pytest.raises(LocalError) as info:
        experiment_from_toml(text, AUTHORITY.public_key)
    assert message in str(info.value)


def test_validator_keys_are_checked() -> None:
    key = VALIDATORS[0].public_key.hex()
    with pytest.raises(LocalError, match=r"validators\[\d\]: .* is not hex"):
        experiment_from_toml(GOOD.replace(key, "zz" * 32), AUTHORITY.public_key)
    with pytest.raises(LocalError, match=r"validators\[\d\]: an Ed25519 public key is 32 bytes"):
        experiment_from_toml(GOOD.replace(key, key[:-2]), AUTHORITY.public_key)
    other = VALIDATORS[1].public_key.hex()
    with pytest.raises(LocalError, match="listed twice"):
        experiment_from_toml(GOOD.replace(other, key), AUTHORITY.public_key)
