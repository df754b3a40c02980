"""Prepare the example's training split as shards that peers serve and trainers fetch.

    python examples/hf_gpt2/prepare_data.py [OUT]     # default: examples/hf_gpt2/prepared

The split is a ``datasets.Dataset`` of ``input_ids`` rows (what ``workload.py`` trains on),
saved with ``save_to_disk`` and prepared from that directory, as ``p2ptrain data prepare
DIR --out OUT`` would: content-addressed shard files and the dataset manifest the
experiment embeds. ``experiment-prepared.toml`` names ``prepared`` (``[data] prepared``);
``p2ptrain demo --experiment-toml examples/hf_gpt2/experiment-prepared.toml`` then trains on
it, every trainer fetching only the shards its leases name.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workload import DEFAULTS, blocks, splits  # noqa: E402

from p2ptrain.data.prepare import prepare_dataset  # noqa: E402


def main(out: Path) -> None:
    train, _ = splits(DEFAULTS)
    dataset = blocks(train, int(DEFAULTS["block_size"]))
    with tempfile.TemporaryDirectory() as saved:
        dataset.save_to_disk(saved)
        prepared = prepare_dataset(
            Path(saved),
            out,
            name="shakespeare-gpt2",
            samples_per_shard=int(DEFAULTS["samples_per_shard"]),
            overwrite=True,
        )
    manifest = prepared.manifest
    print(
        f"{out}: {manifest.total_samples} rows in {len(manifest.shards)} shards "
        f"({manifest.total_bytes / (1 << 20):.1f} MiB)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "prepared")
