"""Training resumed from a draft already written (`faser distill --init-from DIR`): its token map
and weights replace the fresh draft's, so more data refines a draft instead of training a new one
from the target's layers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from faser.distill.model import PROVENANCE_FILE
from faser.models.loader import DRAFT_TOKEN_MAP, load_token_map

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")  # what a layer adds to the stream


def read_token_map(draft_dir: Path) -> torch.Tensor:  # [V'] int64 target ids
    token_map = load_token_map(draft_dir)
    if token_map is None:
        raise FileNotFoundError(f"--init-from: {draft_dir} has no {DRAFT_TOKEN_MAP}: not a draft")
    return token_map


def read_provenance(draft_dir: Path) -> dict | None:
    path = Path(draft_dir) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_weights(draft: torch.nn.Module, draft_dir: Path) -> None:
    """Copies the written weights into `draft` (built as faser.distill.run builds it). A draft
    built with more layers than the written one keeps its extra layers with their output
    projections zeroed: each starts as the identity on the residual stream, so the deeper draft
    starts as the written one and training grows it. Every other trainable tensor must be there
    with its shape, or the drafts differ and this says where."""
    stored = load_file(str(Path(draft_dir) / "model.safetensors"))
    params = dict(draft.named_parameters())
    names = {_param_name(key, params): key for key in stored}
    wanted = {n for n, p in params.items() if p.requires_grad}
    grown = _grown(wanted - names.keys(), _num_layers(names))
    missing = sorted(wanted - names.keys() - grown)
    wrong = sorted(
        n for n, key in names.items() if n in params and params[n].shape != stored[key].shape
    )
    unknown = sorted(key for n, key in names.items() if n not in params)
    if missing or wrong or unknown:
        raise ValueError(
            f"--init-from {draft_dir} is not a draft of this shape (layers, feature layers, "
            f"output vocabulary): missing {missing[:4]}, wrong shape {wrong[:4]}, "
            f"unknown {unknown[:4]}"
        )
    with torch.no_grad():
        for name, key in names.items():
            params[name].copy_(stored[key].to(params[name].dtype))
        for name in grown:
            if name.endswith(OUTPUT_PROJECTIONS):
                params[name].zero_()


def _layer_index(name: str) -> int | None:
    match = LAYER_NAME.search(name)
    return None if match is None else int(match.group(1))


def _num_layers(names) -> int:
    return 1 + max((i for i in map(_layer_index, names) if i is not None), default=-1)


def _grown(missing: set[str], num_written: int) -> set[str]:
    """The missing tensors that belong to layers past the written draft's last."""
    indices = {name: _layer_index(name) for name in missing}
    return {n for n, i in indices.items() if i is not None and i >= num_written > 0}


def _param_name(key: str, params: dict) -> str:
    """A standalone draft stores its body as `model.*` (Hugging Face's names)."""
    if key.startswith("model.") and key not in params:
        return "body." + key.removeprefix("model.")
    return key
