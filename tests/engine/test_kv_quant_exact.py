"""The quantized KV cache's arithmetic pinned on constructed numbers
(engine/kv/quant.py): each group's scale, the codes (int8 rounded half to even,
FP8 E4M3 rounded to its nearest value), the smallest magnitude a group is
scaled by, the numbers read back, and each number's error bound. The values
are powers of two and small integers, so every expected number is exact."""

from __future__ import annotations

import torch

from engine.config.kv_format import FORMATS
from engine.kv.quant import MIN_AMAX, dequantize, error_bound, quantize

INT8, FP8 = FORMATS["int8"], FORMATS["fp8_e4m3"]


def test_int8_scales_each_group_to_127_and_rounds_half_to_even() -> None:
    x = torch.tensor([[127.0, -63.5, 1.0, 0.4, 254.0, 127.0, -254.0, 0.5]])
    codes, scales = quantize(x, INT8, group=4)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.tolist() == [[1.0, 2.0]]
    # Group 1: 127 / 1 ... ; group 2: 254 / 2 = 127, 127 / 2 = 63.5 -> 64, 0.5 / 2 -> 0.
    assert codes.tolist() == [[127, -64, 1, 0, 127, 64, -127, 0]]
    back = dequantize(codes, scales, torch.float64)
    assert back.dtype == torch.float64
    assert back.tolist() == [[127.0, -64.0, 1.0, 0.0, 254.0, 128.0, -254.0, 0.0]]


def test_fp8_scales_each_group_to_448_and_rounds_to_the_nearest_code() -> None:
    # Scale 1: 17 lies halfway between codes 16 and 18 (step 2 in [16, 32)) and
    # goes to 16, the even mantissa; 19 to 20, likewise; -0.5 and 3 are codes.
    x = torch.tensor([448.0, 17.0, 19.0, -0.5, 3.0, 0.0, 1.0, -448.0])
    codes, scales = quantize(x, FP8, group=8)
    assert codes.dtype == torch.float8_e4m3fn
    assert scales.tolist() == [1.0]
    assert codes.float().tolist() == [448.0, 16.0, 20.0, -0.5, 3.0, 0.0, 1.0, -448.0]
    # Scale 2 (amax 896): each number halves, then rounds; read back, doubles.
    codes, scales = quantize(x * 2, FP8, group=8)
    assert scales.tolist() == [2.0]
    assert dequantize(codes, scales, torch.float32).tolist() == [
        896.0,
        32.0,
        40.0,
        -1.0,
        6.0,
        0.0,
        2.0,
        -896.0,
    ]


def test_groups_run_along_the_last_dimension_only() -> None:
    x = torch.zeros(2, 3, 8)
    x[..., 0] = 127.0  # first group of every row: amax 127
    x[..., 4] = torch.arange(6.0).view(2, 3) * 127 + 127  # second: 127, 254, ...
    codes, scales = quantize(x, INT8, group=4)
    assert codes.shape == (2, 3, 8) and scales.shape == (2, 3, 2)
    assert scales[..., 0].tolist() == [[1.0] * 3] * 2
    assert scales[..., 1].tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert (codes[..., 4] == 127).all() and (codes[..., 0] == 127).all()
    assert torch.equal(dequantize(codes, scales, torch.float32), x)


def test_a_group_smaller_than_min_amax_is_scaled_by_min_amax() -> None:
    # Groups far smaller than any key or value still get their own scale: the
    # floor only keeps an all-zero group's scale finite and non-zero.
    for amax in (2.0**-20, 2.0**-66, 2.0**-96):  # the last about 1.3e-29
        small = torch.tensor([[amax, -amax / 4]])
        for fmt, quarter in ((INT8, -32.0), (FP8, -112.0)):  # 127 / 4 = 31.75 rounds to 32
            codes, scales = quantize(small, fmt, group=2)
            assert scales[0, 0] == torch.tensor(amax) / fmt.qmax, (amax, fmt.name)
            assert codes.float().tolist() == [[fmt.qmax, quarter]]
    tiny = torch.tensor([[0.0, 0.0], [MIN_AMAX / 10, 0.0], [MIN_AMAX * 4, 0.0]])
    codes, scales = quantize(tiny, INT8, group=2)
    floor = torch.tensor(MIN_AMAX, dtype=torch.float32) / 127
    assert scales[0, 0] == floor and scales[1, 0] == floor
    assert scales[2, 0] == torch.tensor(MIN_AMAX * 4, dtype=torch.float32) / 127
    # 1/10 of MIN_AMAX on MIN_AMAX's scale: 12.7 -> 13; the zeros stay 0.
    assert codes.tolist() == [[0, 0], [13, 0], [127, 0]]


def test_dequantize_reads_the_group_width_from_the_scales() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6]], dtype=torch.int8)
    scales = torch.tensor([[0.5, 2.0, 4.0]])  # groups of 2
    assert dequantize(codes, scales, torch.float32).tolist() == [[0.5, 1.0, 6.0, 8.0, 20.0, 24.0]]
    scales = torch.tensor([[0.5, 2.0]])  # groups of 3
    assert dequantize(codes, scales, torch.float32).tolist() == [[0.5, 1.0, 1.5, 8.0, 10.0, 12.0]]
    assert dequantize(codes, scales, torch.bfloat16).dtype == torch.bfloat16


def test_the_error_bound_is_half_a_step_for_int8_and_half_an_fp8_ulp() -> None:
    x = torch.tensor([[16.0, 1.0, 2.0**-8, 0.0, 32.0, -4.0, 0.0, 2.0**-6]])
    scales = torch.tensor([[2.0, 1.0]])  # groups of 4
    assert error_bound(x, scales, INT8).tolist() == [[1.0] * 4 + [0.5] * 4]
    assert error_bound(x, scales, INT8).dtype == torch.float64
    # FP8: |x| / 16, and at least half the subnormal step 2^-9 of the scale, 2^-10 * s.
    assert error_bound(x, scales, FP8).tolist() == [
        [1.0, 1 / 16, 2.0**-9, 2.0**-9, 2.0, 0.25, 2.0**-10, 2.0**-10]
    ]
