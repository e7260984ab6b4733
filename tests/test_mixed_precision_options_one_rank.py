"""MixedPrecision: its checks and what it casts per parameter dtype."""

from __future__ import annotations

import pytest
import torch

import thunder_overlap
from thunder_overlap import MixedPrecision

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
ACCEPTED = r"\(torch\.float16, torch\.bfloat16, torch\.float32, torch\.float64\)"


def test_exported_with_the_other_options():
    assert "MixedPrecision" in thunder_overlap.__all__ and thunder_overlap.MixedPrecision is MixedPrecision


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"param_dtype": torch.int32}, rf"^MixedPrecision param_dtype must be a floating torch dtype {ACCEPTED} or None .*int32$"),
        ({"param_dtype": "bf16"}, r"^MixedPrecision param_dtype must be a floating torch dtype .*got 'bf16'$"),
        # Floating, but a float8 gather needs scales this policy has no place for.
        ({"param_dtype": torch.float8_e4m3fn}, r"param_dtype must be a floating torch dtype .*got torch\.float8_e4m3fn$"),
        ({"reduce_dtype": torch.bool}, r"^MixedPrecision reduce_dtype must be a floating torch dtype .*got torch\.bool$"),
        (
            {"param_dtype": FP32, "reduce_dtype": BF16},
            r"^MixedPrecision reduce_dtype=torch\.bfloat16 is not as wide as param_dtype=torch\.float32: .*"
            r"use reduce_dtype=torch\.float32, torch\.float64, or None for the parameter's own dtype$",
        ),
        # As wide, but neither holds the other's values.
        ({"param_dtype": BF16, "reduce_dtype": FP16}, r"reduce_dtype=torch\.float16 is not as wide as param_dtype=torch\.bfloat16"),
    ],
)
def test_bad_policies_name_the_value_and_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixedPrecision(**kwargs)


@pytest.mark.parametrize(
    ("policy", "dtype", "expected"),
    [
        # reduce_dtype=None keeps the parameter's own dtype (FSDP2's would mean param_dtype).
        (MixedPrecision(BF16), FP32, (BF16, FP32)),
        (MixedPrecision(BF16, FP32), FP32, (BF16, FP32)),
        (MixedPrecision(BF16, BF16), FP32, (BF16, BF16)),
        (MixedPrecision(reduce_dtype=BF16), FP32, (FP32, BF16)),
        (MixedPrecision(FP32, FP64), FP32, (FP32, FP64)),
        # Clamped as FSDP2 clamps: nothing to cast for a parameter already in these dtypes.
        (MixedPrecision(BF16), BF16, None),
        (MixedPrecision(BF16, BF16), BF16, None),
        (MixedPrecision(FP32, FP32), FP32, None),
        (MixedPrecision(), FP32, None),
        (MixedPrecision(BF16), torch.int64, None),
    ],
)
def test_dtypes_per_parameter(policy, dtype, expected):
    assert policy.dtypes_for(dtype) == expected
