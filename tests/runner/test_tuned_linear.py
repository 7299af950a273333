"""The "tuned" layout: every kernel it may choose gives the dense product at every row count, the
choice is the measured fastest, it is read back from its cache, and it stays within its memory
budget."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from faser.runner.tuned_linear import (
    KERNELS,
    ROW_BUCKETS,
    KernelChoice,
    TunedLinear,
    cached_tune_group,
    tune_group,
)
from faser.runner.weights import pack_weights
from tests.runner.test_weights import _TinyModel

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")

MIXED = ("transposed", "packed", "onednn", "packed", "transposed", "onednn", "dense")


@pytest.mark.parametrize("kernels", [(k,) * len(ROW_BUCKETS) for k in KERNELS] + [MIXED])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 40])
def test_every_kernel_gives_the_dense_product(kernels, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 40, bias=False)
    tuned = TunedLinear(linear, KernelChoice(ROW_BUCKETS, kernels))
    x = torch.randn(rows, 64)
    out = tuned(x)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_a_batch_runs_the_choice_of_the_first_bucket_that_holds_it():
    choice = KernelChoice(ROW_BUCKETS, MIXED)
    assert choice.kernel_for(1) == ("transposed", 1)
    assert choice.kernel_for(3) == ("onednn", 3)
    assert choice.kernel_for(5) == ("transposed", 8)
    assert choice.kernel_for(32) == ("dense", 32)
    assert choice.kernel_for(500) == ("dense", 500)  # past the last bucket: plain GEMM


def test_only_the_chosen_layouts_are_kept():
    linear = nn.Linear(16, 8, bias=False)
    tuned = TunedLinear(linear, KernelChoice((1, 4), ("dense", "packed")))
    buffers = {name for name, _ in tuned.named_buffers()}
    assert buffers == {"packed_4"}
    assert tuned.weight is linear.weight  # shared, not copied


def test_tuning_picks_the_fastest_kernel_of_each_bucket():
    fastest = {1: "transposed", 2: "onednn", 4: "packed", 8: "dense"}
    calls = []

    def timer(kernel, rows, run):
        calls.append((kernel, rows))
        run()  # the kernel really runs: a broken layout fails here
        return 1.0 if kernel == fastest[rows] else 2.0

    choice = tune_group([nn.Linear(16, 8, bias=False)], buckets=(1, 2, 4, 8), timer=timer)
    assert choice == KernelChoice((1, 2, 4, 8), ("transposed", "onednn", "packed", "dense"))
    assert len(calls) == 4 * len(KERNELS) * 5


def test_a_choice_is_read_back_from_its_cache_and_a_broken_cache_is_measured_again(tmp_path):
    cache = tmp_path / "layouts.json"
    linears = [nn.Linear(16, 8, bias=False)]
    first = cached_tune_group(linears, cache, timer=lambda kernel, rows, run: len(kernel))
    assert first.kernels == ("dense",) * len(ROW_BUCKETS)  # the shortest name is the fastest

    def never(kernel, rows, run):
        raise AssertionError("a cached choice was measured again")

    assert cached_tune_group(linears, cache, timer=never) == first
    cache.write_text(json.dumps({key: ["warp"] for key in json.loads(cache.read_text())}))
    again = cached_tune_group(linears, cache, timer=lambda kernel, rows, run: -len(kernel))
    assert again.kernels == ("transposed",) * len(ROW_BUCKETS)


def test_tuned_packing_keeps_a_tied_head_tied_and_stays_within_its_budget(monkeypatch):
    choice = KernelChoice(ROW_BUCKETS, MIXED)  # as if measured: copies for transposed, packed
    monkeypatch.setattr("faser.runner.weights.cached_tune_group", lambda linears, cache: choice)
    monkeypatch.setattr("faser.runner.weights._available_memory", lambda: 2**40)
    model = _TinyModel(bias=True)
    embed = model.embed_tokens.weight
    pack_weights(model, "tuned", "cpu")
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear)  # has a bias
    assert isinstance(model.layers[0].mlp.down_proj, TunedLinear)
    assert isinstance(model.lm_head, TunedLinear)
    assert model.lm_head.weight is embed  # no copy of the tied embedding
    monkeypatch.setattr("faser.runner.weights._available_memory", lambda: 0)
    poor = _TinyModel(bias=False)
    pack_weights(poor, "tuned", "cpu")
    assert not any(isinstance(m, TunedLinear) for m in poor.modules())  # no room for a copy


def test_an_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="warp"):
        KernelChoice((1,), ("warp",))
