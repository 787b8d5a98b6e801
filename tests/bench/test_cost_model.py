"""The arithmetic-share model against counts made by hand on a tiny model's shape."""

import pytest
import torch

from cacheclip_bench.cost_model import Shape, arithmetic_share, macs, parts, shares


def test_counts_by_hand_rows_late_cost_more_than_rows_early():
    # one layer, hidden 4, MLP 8, 2 heads of 2, 1 KV head: per row 2*4*2*2 + 2*4*1*2 + 3*4*8 = 32 + 16 + 96 = 144
    shape = Shape(hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, windows=(None,))
    assert shape.dense_per_row == 144
    # rows at positions 0 and 9 see 1 and 10 keys: attention 2 * heads * head_dim * keys = 8 per key
    assert macs(shape, torch.tensor([0, 9])) == 2 * 144 + 8 * (1 + 10)
    full = 10 * 144 + 8 * sum(range(1, 11))  # a 10-token prefill: every row, keys 1..10
    assert macs(shape, torch.arange(10)) == full
    late, early = arithmetic_share(shape, torch.tensor([8, 9]), 10), arithmetic_share(shape, torch.tensor([0, 1]), 10)
    assert late == pytest.approx((2 * 144 + 8 * 19) / full) and early == pytest.approx((2 * 144 + 8 * 3) / full)
    assert late > 0.2 > early  # 20% of the rows: more than 20% of the work late in the prompt, less early
    assert arithmetic_share(shape, torch.arange(10), 10) == pytest.approx(1.0)


def test_the_dense_and_attention_parts_sum_to_the_whole():
    shape = Shape(hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, windows=(None,))
    assert parts(shape, torch.tensor([0, 9])) == (2 * 144, 8 * (1 + 10))
    dense, attention = shares(shape, torch.tensor([8, 9]), 10)
    full = 10 * 144 + 8 * sum(range(1, 11))
    assert dense == pytest.approx(2 * 144 / full) and attention == pytest.approx(8 * 19 / full)
    assert dense + attention == pytest.approx(arithmetic_share(shape, torch.tensor([8, 9]), 10))


def test_a_sliding_window_caps_the_keys_a_row_sees():
    shape = Shape(hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, windows=(None, 3))
    # layer 0 sees 10 keys, layer 1 (window 3) sees 3
    assert macs(shape, torch.tensor([9])) == 2 * 144 + 8 * 10 + 8 * 3


def test_the_shape_of_a_loaded_model(tiny_pair):
    primary = tiny_pair[0]
    shape = Shape.of(primary)
    cfg = primary.model.config
    assert shape.hidden == cfg.hidden_size and len(shape.windows) == cfg.num_hidden_layers
    assert shape.heads * shape.head_dim >= cfg.hidden_size // 2
