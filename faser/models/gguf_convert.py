"""GGUF file -> Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer).

transformers reads a GGUF file (dequantising its tensors) but refuses to save a model loaded that
way, because its config carries a GGUF `quantization_config`. So: load through transformers' GGUF
support, rebuild the same architecture from the config without that entry, move the weights over
and save it as a plain float32 safetensors checkpoint, which then loads anywhere without the GGUF.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

logger = logging.getLogger(__name__)

# Bumped whenever the output of convert_gguf changes, so that old cache entries are not reused.
CONVERTER_VERSION = 1

# SmolLM2-Instruct's own ChatML template, used when a GGUF file carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def convert_gguf(gguf_path: Path, out_dir: Path, provenance: dict | None = None) -> Path:
    """Write the checkpoint of `gguf_path` into `out_dir` (created if missing); returns out_dir.
    `provenance` is recorded in out_dir/faser_source.json beside the converter's own facts."""
    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s -> %s", gguf_path, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        logger.info("%s has no chat template; using SmolLM2's ChatML template", gguf_path.name)
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    model = plain_model(load_gguf_model(gguf_path))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _write_provenance(out_dir, gguf_path, provenance or {})
    for file in out_dir.iterdir():
        # safetensors writes 0600; a cache shared between users (or containers) must stay readable.
        if file.is_file():
            file.chmod(0o644)
    return out_dir


def load_gguf_model(gguf_path: Path) -> PreTrainedModel:
    """The model as transformers' GGUF support loads it (dequantised to float32)."""
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


def plain_model(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """The same architecture and weights, without the GGUF quantization config (so it saves)."""
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    _check_tied(model)
    return model.eval()


def _check_tied(model: PreTrainedModel) -> None:
    # A tied checkpoint saved untied would double the embedding memory and drift under training.
    if not model.config.tie_word_embeddings:
        return
    head = model.get_output_embeddings().weight
    if head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("tie_word_embeddings is set but lm_head and embed_tokens are distinct")


def _write_provenance(out_dir: Path, gguf_path: Path, extra: dict) -> None:
    record = {"source_gguf": gguf_path.name, "converter_version": CONVERTER_VERSION, **extra}
    (out_dir / "faser_source.json").write_text(json.dumps(record, indent=2) + "\n")
