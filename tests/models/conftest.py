"""A tiny Llama GGUF file, written with the `gguf` package the way llama.cpp lays one out.

Two layers, hidden 64, a byte-level BPE vocabulary of ~300 tokens with ChatML special tokens and
merges, quantised like SmolLM2's file (Q8_0 embedding, Q4_1 linear layers, F32 norms), so the
conversion runs the same dequantisation and tokenizer paths as the real model in a second.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("hello", "world", "the", "user", "assistant", "system", "Ġthe", "Ġworld", "Ġhello")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // NUM_HEADS


def tiny_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges): specials, the 256 byte symbols, then one token per merge step of WORDS."""
    tokens = [*SPECIAL_TOKENS, *(bytes_to_unicode()[b] for b in range(256))]
    merges: list[str] = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            if word[:end] not in tokens:
                merges.append(f"{word[: end - 1]} {word[end - 1]}")
                tokens.append(word[:end])
    return tokens, merges


def _add_tokenizer(writer: GGUFWriter, chat_template: str | None) -> int:
    tokens, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    token_types = [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    writer.add_token_types(token_types + [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


def _add_hparams(writer: GGUFWriter, vocab_size: int) -> None:
    writer.add_name("faser tiny llama")
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)


def _tensor_shapes(vocab_size: int, tied: bool) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape as [out_features, in_features] (numpy order)."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, HIDDEN)}
    for i in range(NUM_LAYERS):
        block = {
            "attn_norm": (HIDDEN,),
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": (NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_norm": (HIDDEN,),
            "ffn_gate": (INTERMEDIATE, HIDDEN),
            "ffn_up": (INTERMEDIATE, HIDDEN),
            "ffn_down": (HIDDEN, INTERMEDIATE),
        }
        shapes |= {f"blk.{i}.{part}.weight": shape for part, shape in block.items()}
    shapes["output_norm.weight"] = (HIDDEN,)
    if not tied:
        shapes["output.weight"] = (vocab_size, HIDDEN)
    return shapes


def _add_tensors(writer: GGUFWriter, vocab_size: int, tied: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name, shape in _tensor_shapes(vocab_size, tied).items():
        if len(shape) == 1:  # norms stay F32, as llama.cpp keeps them
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        weight = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        is_embedding = name in ("token_embd.weight", "output.weight")
        qtype = GGMLQuantizationType.Q8_0 if is_embedding else GGMLQuantizationType.Q4_1
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    path: Path, chat_template: str | None = CHAT_TEMPLATE, tied: bool = True, seed: int = 0
) -> Path:
    writer = GGUFWriter(path, "llama")
    vocab_size = _add_tokenizer(writer, chat_template)
    _add_hparams(writer, vocab_size)
    _add_tensors(writer, vocab_size, tied, seed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def make_tiny_gguf(tmp_path: Path) -> Callable[..., Path]:
    """write_tiny_gguf(name, **options) into a fresh directory under tmp_path."""

    def make(name: str = "tiny.gguf", **options: object) -> Path:
        folder = tmp_path / f"gguf-{name}-{len(list(tmp_path.glob('gguf-*')))}"
        folder.mkdir()
        return write_tiny_gguf(folder / name, **options)

    return make


@pytest.fixture
def tiny_gguf(make_tiny_gguf: Callable[..., Path]) -> Path:
    return make_tiny_gguf()


@pytest.fixture
def tiny_chat_template() -> str:
    """The chat template write_tiny_gguf stores by default."""
    return CHAT_TEMPLATE


DRAFT_TEST_VOCAB = 97  # the vocabulary of `tiny_target`, a target for the draft tests


@pytest.fixture
def tiny_target(tmp_path: Path) -> tuple[LlamaForCausalLM, Path]:
    config = LlamaConfig(
        vocab_size=DRAFT_TEST_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    target.save_pretrained(tmp_path / "target")
    return target, tmp_path / "target"
