"""FSDPOverlapStrategy's options and Fabric's precision, checked where they are given: when the
strategy or ``Fabric(...)`` is built, before any process starts. One process, no ranks."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

from thunder_overlap import MixedPrecision
from thunder_overlap.fabric import FSDPOverlapStrategy
from thunder_overlap.fabric._precision import BF16_MIXED


def test_the_strategy_is_registered_by_name_with_the_defaults():
    strategy = Fabric(accelerator="cpu", devices=1, strategy="thunder_overlap").strategy
    assert isinstance(strategy, FSDPOverlapStrategy)
    assert (str(strategy._sharding), str(strategy._bucketing), strategy.state_dict_type) == ("zero3", "block", "sharded")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"sharding_strategy": "zero4"}, ValueError, r"zero4"),
        ({"bucketing_strategy": "blocks"}, ValueError, r"blocks"),
        ({"mixed_precision": torch.bfloat16}, TypeError, r"mixed_precision must be a thunder_overlap.MixedPrecision or None, got torch.bf"),
        ({"config": {"prefetch": 2}}, TypeError, r"config must be a thunder_overlap.OverlapConfig or None"),
        ({"activation_checkpointing": "block"}, TypeError, r"activation_checkpointing must be a bool, got 'block'"),
        ({"jit_options": ["torch"]}, TypeError, r"jit_options must be a dict of thunder.jit keywords or None"),
        ({"state_dict_type": "local"}, ValueError, r"state_dict_type must be one of 'sharded', 'full', got 'local'"),
        ({"hybrid_sharding": "yes"}, TypeError, r"hybrid_sharding must be a bool, got 'yes'"),
    ],
)  # fmt: skip
def test_bad_options_are_named_when_the_strategy_is_built(options, error, message):
    with pytest.raises(error, match=message):
        FSDPOverlapStrategy(**options)


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ("16-true", r"supports Fabric\(precision=...\) '32-true', 'bf16-true', 'bf16-mixed', got '16-true' \(plugin HalfPrecision\)"),
        ("64-true", r"got '64-true' \(plugin DoublePrecision\)"),
    ],
)
def test_an_unsupported_precision_is_refused_when_fabric_is_built(precision, message):
    with pytest.raises(ValueError, match=message):
        Fabric(accelerator="cpu", devices=1, strategy=FSDPOverlapStrategy(), precision=precision)


def test_16_mixed_says_why_it_cannot_be_honoured():
    from lightning.fabric.plugins.precision import Precision

    from thunder_overlap.fabric._precision import resolve_precision

    # Fabric turns "16-mixed" into "bf16-mixed" on a CPU, so a plugin saying "16-mixed" is given directly.
    plugin = Precision()
    plugin.precision = "16-mixed"
    with pytest.raises(ValueError, match=r"'16-mixed'\) needs a gradient scaler that unscales sharded gradients"):
        resolve_precision(plugin, None)


def test_bf16_mixed_shards_with_bf16_gathers_over_float32_masters_and_no_autocast():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPOverlapStrategy(), precision="bf16-mixed")
    assert fabric.strategy._mixed_precision == MixedPrecision(torch.bfloat16, torch.float32) == BF16_MIXED
    with fabric.strategy.precision.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    # The same policy given both ways is one setting; another is a conflict.
    Fabric(accelerator="cpu", devices=1, strategy=FSDPOverlapStrategy(mixed_precision=BF16_MIXED), precision="bf16-mixed")
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'\) means mixed_precision=.* but the strategy was given"):
        strategy = FSDPOverlapStrategy(mixed_precision=MixedPrecision(torch.float16))
        Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed")


def test_hybrid_sharding_needs_more_than_one_node():
    with pytest.raises(ValueError, match=r"hybrid_sharding=True replicates across nodes and needs num_nodes > 1, got num_nodes=1"):
        Fabric(accelerator="cpu", devices=2, strategy=FSDPOverlapStrategy(hybrid_sharding=True))
