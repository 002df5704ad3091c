"""The tiled layout the megakernel streams attention's, the router's and the embedding's weights
in (megakernel.tiled_layout; include/northmk.h gives the formula the kernel indexes by)."""
import pytest
import torch

from northmk.megakernel import tiled_layout


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


def test_tiled_bytes_are_the_padded_copies_of_attention_the_router_and_the_embedding(tmp_path):
    from northmk.checkpoint import load_checkpoint
    from northmk.checkpoint_writer import config_dict, write_checkpoint
    from northmk.megakernel import tiled_bytes, tiled_copies

    config, weights = load_checkpoint(write_checkpoint(tmp_path, config_dict("tiny"), seed=0, dtype="float32"))
    copies = tiled_copies(weights)
    sparse = sum(lw.router is not None for lw in weights.layers)
    assert len(copies) == 2 * config.num_layers + sparse + 1 and copies[-1] is weights.embed
    assert tiled_bytes(weights) == sum(tiled_layout(w).numel() * w.element_size() for w in copies)
