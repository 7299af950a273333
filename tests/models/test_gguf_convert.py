"""GGUF -> safetensors checkpoint: the converted model is the GGUF-loaded model, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from faser.models.gguf_convert import SMOLLM2_CHAT_TEMPLATE, convert_gguf, load_gguf_model

PROMPT = "hello world, the user<|im_end|> and the assistant: 12 é"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _logits(model: torch.nn.Module, input_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits  # [1, num_tokens, vocab]


@pytest.mark.parametrize("tied", [True, False])
def test_converted_checkpoint_gives_the_gguf_models_logits(
    make_tiny_gguf: Callable[..., Path], tmp_path: Path, tied: bool
) -> None:
    gguf_path = make_tiny_gguf(tied=tied)
    out = convert_gguf(gguf_path, tmp_path / "ckpt")

    assert (out / "model.safetensors").is_file()
    assert not list(out.glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # plain: no gguf_file
    reference = load_gguf_model(gguf_path).eval()
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings is tied
    shares = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shares is tied

    input_ids = AutoTokenizer.from_pretrained(out)(PROMPT).input_ids
    assert torch.equal(_logits(model, input_ids), _logits(reference, input_ids))


def test_tokenizer_and_chat_template_come_through(
    tiny_gguf: Path, tiny_chat_template: str, tmp_path: Path
) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "ckpt")
    converted = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)

    assert converted(PROMPT).input_ids == original(PROMPT).input_ids
    assert converted.decode(converted(PROMPT).input_ids) == PROMPT
    assert converted.chat_template == tiny_chat_template
    assert (converted.bos_token, converted.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = converted.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert converted("<|im_start|>x<|im_end|>").input_ids[::2] == ids  # specials stay whole


def test_missing_chat_template_falls_back_to_smollm2_chatml(
    make_tiny_gguf: Callable[..., Path], tmp_path: Path
) -> None:
    out = convert_gguf(make_tiny_gguf(chat_template=None), tmp_path / "ckpt")
    tokenizer = AutoTokenizer.from_pretrained(out)

    assert tokenizer.chat_template == SMOLLM2_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_generation_config_and_provenance_are_written(tiny_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "ckpt", provenance={"origin": "test"})
    model = AutoModelForCausalLM.from_pretrained(out)

    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (1, 2)
    assert '"origin": "test"' in (out / "faser_source.json").read_text()
