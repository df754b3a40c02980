"""A whole network of real processes on loopback trains a model: a seed, 2 validators
(quorum 2, no reducer, so the validators propose) and 3 trainers certify windows, the
certified model's validation loss falls, and every node ends on the same head."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS, head_blob_ids
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.datadir import BLOBS_DIR
from p2ptrain.torch.char_gpt import char_gpt_workload
from tests.support.local_net import (
    TINY_CONFIG,
    Net,
    check_one_tip,
    genesis_and_tip,
    local_net,
    stored_chain,
)

__all__ = ["local_net"]  # the fixture

pytestmark = pytest.mark.integration

WINDOWS = 4


def test_the_network_certifies_windows_and_the_loss_falls(local_net: Net) -> None:
    net = local_net
    net.launch(validators=2, reducers=0, trainers=3, quorum=2, min_updates=2, windows=WINDOWS)
    net.finish(timeout_s=60.0)

    chain = [head for head, _certificate in stored_chain(net.data_dir("seed"))]
    net.check(
        [head.height for head in chain] == list(range(1, WINDOWS + 1)),
        f"the seed should keep the heads of heights 1..{WINDOWS}",
    )
    net.check(all(len(head.accepted) >= 2 for head in chain), "a head accepts too few updates")
    check_one_tip(net, WINDOWS)
    # the seed runs with --archive: it keeps every head's blobs, the others their last few
    with BlobStore(net.data_dir("seed") / BLOBS_DIR) as blobs:
        net.check(
            all(blobs.has(b) for head in chain for b in head_blob_ids(head)),
            "the archive seed should keep the blobs of every head",
        )
    net.check(net.status("seed")["keep_heads"] is None, "the seed runs with --archive")
    net.check(net.status("trainer-0")["keep_heads"] == DEFAULT_KEEP_HEADS, "trainer-0 keeps")

    genesis, height, weights = genesis_and_tip(net.data_dir("seed"))
    torch.set_num_threads(1)
    workload = char_gpt_workload(TINY_CONFIG)
    before, after = workload.evaluate(genesis), workload.evaluate(weights)
    net.check(
        after < before - 0.1,
        f"the validation loss should fall: genesis {before:.4f}, height {height} {after:.4f}",
    )
