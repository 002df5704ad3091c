"""The tiled layout the megakernel streams every weight matrix in (megakernel.tiled_layout,
model.weights.to_tiled; include/northmk.h gives the formula the kernel indexes by): copies of
attention's, the router's, the dense MLP's and the embedding's, the experts in place."""
import dataclasses

import pytest
import torch

from northmk.checkpoint import checkpoint_tensors, load_checkpoint
from northmk.checkpoint_writer import config_dict, write_checkpoint
from northmk.config import PAGE_SIZE
from northmk.megakernel import tiled_bytes, tiled_copies, tiled_layout
from northmk.model.kv import BatchLayout, PagedKVCache
from northmk.model.reference import ReferenceModel
from northmk.model.weights import from_tiled, tile_experts_, to_tiled, untile_experts_


@pytest.fixture
def tiny(tmp_path):
    return load_checkpoint(write_checkpoint(tmp_path, config_dict("tiny"), seed=0, dtype="float32"))


def test_element_r_c_lies_where_the_header_says_and_the_last_band_is_padded_with_zeros():
    rows, k = 37, 96  # three bands, the last with 5 real rows
    w = torch.arange(rows * k, dtype=torch.float32).view(rows, k) + 1
    flat = tiled_layout(w)
    assert flat.shape == (48 * k,)
    for r in range(rows):
        for c in range(k):
            assert flat[(r - r % 16) * k + (c // 32) * 512 + (r % 16) * 32 + c % 32] == w[r, c]
    assert flat.count_nonzero() == rows * k  # the 11 padding rows are zeros


def test_a_warp_load_reads_one_row_band_block_in_lane_order():
    # lane l = 4 g + t loads columns 8 t .. 8 t + 7 of rows g and g + 8 of each 32-wide block
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    flat = tiled_layout(w)
    band, block = 1, 1
    base = band * 16 * 64 + block * 512
    for lane in range(32):
        g, t = divmod(lane, 4)
        cols = slice(block * 32 + 8 * t, block * 32 + 8 * t + 8)
        assert torch.equal(flat[base + 8 * lane: base + 8 * lane + 8], w[16 * band + g, cols])
        assert torch.equal(flat[base + 256 + 8 * lane: base + 256 + 8 * lane + 8], w[16 * band + 8 + g, cols])


@pytest.mark.parametrize("shape", [(16, 48), (16,), (2, 16, 32)])
def test_other_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="multiple of 32"):
        tiled_layout(torch.zeros(shape))


def test_tiled_bytes_are_the_padded_copies_of_all_but_the_experts(tiny):
    config, weights = tiny
    copies = tiled_copies(weights)
    sparse = sum(lw.router is not None for lw in weights.layers)
    assert len(copies) == 2 * config.num_layers + sparse + 2 * (config.num_layers - sparse) + 1
    assert copies[-1] is weights.embed
    assert tiled_bytes(weights) == sum(tiled_layout(w).numel() * w.element_size() for w in copies)


def test_to_tiled_is_the_copies_layout_per_matrix_and_from_tiled_undoes_it():
    w = torch.randn(3, 48, 96)
    tiled = to_tiled(w)
    assert tiled.shape == w.shape and tiled.is_contiguous()
    for e in range(3):
        assert torch.equal(tiled[e].flatten(), tiled_layout(w[e]))
    assert torch.equal(from_tiled(tiled), w)
    with pytest.raises(ValueError, match="rows % 16"):
        to_tiled(torch.zeros(2, 40, 64))


def test_experts_tiled_in_place_keep_their_storage_and_read_back_row_major(tiny):
    config, weights = tiny
    layer = next(lw for lw in weights.layers if lw.router is not None)
    rows = [tuple(t.clone() for t in layer.expert(e)) for e in range(config.num_experts)]
    storage = layer.experts_gate_up.data_ptr(), layer.experts_down.data_ptr()
    tile_experts_(weights)
    tile_experts_(weights)  # a second call leaves them as they are
    assert layer.experts_tiled and (layer.experts_gate_up.data_ptr(), layer.experts_down.data_ptr()) == storage
    assert torch.equal(layer.experts_gate_up[1].flatten(), tiled_layout(rows[1][0]))
    for e, (gate_up, down) in enumerate(rows):
        got = layer.expert(e)
        assert torch.equal(got[0], gate_up) and torch.equal(got[1], down)
    untile_experts_(weights)
    assert not layer.experts_tiled
    assert torch.equal(layer.experts_gate_up[2], rows[2][0]) and torch.equal(layer.experts_down[2], rows[2][1])


def test_the_reference_reads_tiled_experts_and_checkpoints_write_them_row_major(tiny):
    config, weights = tiny
    row_major = dataclasses.replace(weights, layers=[dataclasses.replace(lw) for lw in weights.layers])
    for lw in row_major.layers:
        if lw.experts_gate_up is not None:
            lw.experts_gate_up, lw.experts_down = lw.experts_gate_up.clone(), lw.experts_down.clone()
    tile_experts_(weights)
    assert not any(lw.experts_tiled for lw in row_major.layers)
    tokens = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))

    def prefill(w):
        kv = PagedKVCache(config, [1] * len(config.attention_groups), torch.float32, "cpu")
        table = torch.zeros(1, 1, dtype=torch.int32)
        layout = BatchLayout([len(tokens)], [0], [table] * len(kv.pages))
        assert len(tokens) <= PAGE_SIZE
        return ReferenceModel(config, w).forward(tokens, layout, kv)

    torch.testing.assert_close(prefill(weights), prefill(row_major), rtol=1e-5, atol=1e-5)
    for fused in (False, True):
        got = dict(checkpoint_tensors(config, weights, fused_experts=fused))
        want = dict(checkpoint_tensors(config, row_major, fused_experts=fused))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
