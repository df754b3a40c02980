"""Certified weights as a Hugging Face model directory (the ``hf`` export format).

:func:`write_hf_export` loads the weights into the workload's ``transformers`` model and
writes, into one directory:

* ``config.json``, ``model.safetensors`` (or its shards and index, for a large model) and
  ``generation_config.json``: ``save_pretrained``'s output, so that
  ``AutoModelForCausalLM.from_pretrained(directory)`` loads the model;
* ``vocab.json``, when the workload has a vocabulary (``workload.vocab``: the built-in
  corpus's characters, or those of the prepared ``chars`` dataset the experiment trained
  on): ``{token: id}``, one entry per token id. It is a plain table, not a ``transformers``
  tokenizer (there is no ``tokenizer_config.json``): decode ids with ``"".join(token_of[i]
  for i in ids)`` where ``token_of`` inverts the table; the model card shows how. A model
  trained on prepared ``bytes`` ids decodes with ``bytes(ids).decode("utf-8")``; one
  trained on the ids of a Hugging Face tokenizer names that tokenizer in its card (the
  tokenizer's files are not part of the experiment, so not of the export);
* ``README.md``: a model card with every entry of ``card`` (experiment id, head, height,
  certificate signers, validation loss, ...) in a table, and a usage snippet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from p2ptrain.core.manifests import TokenizerSpec
from p2ptrain.errors import LocalError
from p2ptrain.torch.hf_causal_lm import import_transformers
from p2ptrain.torch.workload import TorchWorkload

__all__ = ["model_card", "write_hf_export"]


def _cell(value: Any) -> str:
    if isinstance(value, list | tuple):
        text = ", ".join(str(item) for item in value)
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _decode_lines(has_vocab: bool, tokenizer: TokenizerSpec | None) -> str:
    """The usage snippet's lines that turn generated ids into text."""
    if has_vocab:
        return (
            'token_of = {i: t for t, i in json.load(open(f"{path}/vocab.json")).items()}\n'
            'print("".join(token_of[i] for i in ids[0].tolist()))\n'
        )
    if tokenizer is not None and tokenizer.kind == "bytes":
        return 'print(bytes(ids[0].tolist()).decode("utf-8", "replace"))\n'
    if tokenizer is not None and tokenizer.kind == "huggingface":
        return (
            f"# the ids are those of the {tokenizer.name or 'Hugging Face'} tokenizer the "
            "data was prepared with (not in this directory):\n"
            "# print(tokenizer.decode(ids[0]))\n"
        )
    return "print(ids)\n"


def model_card(
    card: Mapping[str, Any], *, has_vocab: bool, tokenizer: TokenizerSpec | None = None
) -> str:
    """The README.md of an export: ``card`` as a table, then how to load and sample
    (decoding ids with ``vocab.json`` when ``has_vocab``, else as ``tokenizer`` made
    them)."""
    rows = "\n".join(f"| {_cell(key)} | {_cell(value)} |" for key, value in card.items())
    decode = _decode_lines(has_vocab, tokenizer)
    return (
        "---\nlibrary_name: transformers\ntags:\n- p2ptrain\n---\n\n"
        "# Model trained with p2ptrain\n\n"
        "Weights certified by the network (DiLoCo training on untrusted peers).\n\n"
        f"| Field | Value |\n|---|---|\n{rows}\n\n"
        "## Usage\n\n"
        "```python\n"
        "import json\n\nimport torch\n"
        "from transformers import AutoModelForCausalLM\n\n"
        'path = "."  # this directory\n'
        "model = AutoModelForCausalLM.from_pretrained(path)\n"
        "# at most the positions the model was trained with (its context length)\n"
        "config = model.config\n"
        'context = getattr(config, "n_positions", None) or config.max_position_embeddings\n'
        "new = min(50, context - 1)\n"
        "ids = model.generate(torch.tensor([[0]]), max_new_tokens=new, do_sample=True)\n"
        f"{decode}```\n"
        + (
            "\n`vocab.json` maps each token to its id; it is a plain table, not a "
            "`transformers` tokenizer (there is no `tokenizer_config.json`).\n"
            if has_vocab
            else ""
        )
    )


def write_hf_export(
    workload: TorchWorkload,
    weights: Mapping[str, torch.Tensor],
    out_dir: Path,
    card: Mapping[str, Any],
) -> dict[str, str]:
    """Write ``weights`` as a Hugging Face model directory in ``out_dir`` (see the module
    docstring); ``out_dir`` must not exist or be empty. Returns ``{file name: path}`` of
    every file written."""
    transformers = import_transformers()
    model = workload.model
    if not isinstance(model, transformers.PreTrainedModel):
        raise LocalError(
            f"the hf export format needs a Hugging Face model (transformers.PreTrainedModel); "
            f"this workload's model is a {type(model).__name__}: export it in the plain "
            "safetensors format instead"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise LocalError(
            f"{out_dir} exists and is not an empty directory; an export writes a whole model "
            "directory: give a new path or empty it first"
        )
    workload.full_state_dict(weights)  # loads the weights into the model's parameters
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    written = {path.name: str(path) for path in sorted(out_dir.iterdir())}
    if not any(name.endswith(".safetensors") for name in written):
        raise LocalError(
            f"save_pretrained wrote no .safetensors file in {out_dir} ({sorted(written)}); "
            "install transformers>=4.40 (pip install 'p2ptrain[hf]')"
        )
    if workload.vocab is not None:
        table = {token: index for index, token in enumerate(workload.vocab)}
        if len(table) != len(workload.vocab):
            raise LocalError(
                "the workload's vocabulary repeats a token; vocab.json needs each once"
            )
        vocab_path = out_dir / "vocab.json"
        vocab_path.write_text(json.dumps(table, ensure_ascii=False, indent=1) + "\n", "utf-8")
        written["vocab.json"] = str(vocab_path)
    readme = out_dir / "README.md"
    tokenizer = workload.tokenizer
    if tokenizer is not None:
        card = {
            **card,
            "tokenizer": f"{tokenizer.kind}{f' ({tokenizer.name})' if tokenizer.name else ''}, "
            f"{tokenizer.vocab_size} ids, rows of {tokenizer.block_size} tokens",
        }
    text = model_card(card, has_vocab=workload.vocab is not None, tokenizer=tokenizer)
    readme.write_text(text, "utf-8")
    written["README.md"] = str(readme)
    return written
