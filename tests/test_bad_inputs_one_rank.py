"""Every bad input gets a clear error naming the bad value and what is accepted; nothing hangs."""

from __future__ import annotations

import functools
import inspect

import pytest
import thunder
import torch
import torch.distributed as dist
import torch.nn as nn

import thunder_overlap
from thunder_overlap import BucketingTransform, FSDPOverlap, OverlapConfig, Zero3Transform, schedule_stats
from thunder_overlap._scheduling.limits import resolve_limits
from thunder_overlap.config import Tuning
from thunder_overlap.options import (
    BucketingStrategy,
    FSDPOptions,
    ShardingStrategy,
    parse_bucketing_strategy,
    parse_sharding_strategy,
    resolve_keywords,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_without_a_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        thunder_overlap.fsdp(_model())


@pytest.fixture(scope="module")
def gloo_group(one_rank_gloo_group):
    return one_rank_gloo_group


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"sharding_strategy": "zero4"},
            ValueError,
            r"^sharding_strategy must be 'zero2', 'zero3' or 'auto' \(or FSDPType\.ZERO2/ZERO3\), got 'zero4'$",
        ),
        ({"sharding_strategy": 3}, ValueError, r"sharding_strategy must be 'zero2', 'zero3' or 'auto' .*, got 3$"),
        (
            {"bucketing_strategy": "buckets"},
            ValueError,
            r"^bucketing_strategy must be 'none', 'layer', 'block' or 'auto' "
            r"\(or FSDPBucketingStrategy\.NONE/LAYER/BLOCK\), got 'buckets'$",
        ),
        # A member of the other strategy enum is not silently read as its string value.
        ({"sharding_strategy": BucketingStrategy.NONE}, ValueError, r"sharding_strategy must be .*got <BucketingStrategy.NONE"),
        ({"bucket_cap_mb": 25}, ValueError, r"bucket_cap_mb=25 needs bucketing_strategy 'layer', 'block' or 'auto'"),
        ({"bucket_cap_mb": 0, "bucketing_strategy": "block"}, ValueError, r"bucket_cap_mb must be a positive .*got 0"),
        ({"bucket_cap_mb": "25", "bucketing_strategy": "layer"}, ValueError, r"bucket_cap_mb must be a positive .*got '25'"),
        ({"device": "cuda"}, ValueError, r"device='cuda' does not match .*'gloo'.*cpu"),
        ({"device": "meta"}, ValueError, r"device='meta' does not match"),
        ({"device": "potato"}, ValueError, r"device='potato' is not a valid torch device"),
        ({"broadcast_from": 3}, ValueError, r"broadcast_from=3 is not a rank .*0\.\.0"),
        ({"broadcast_from": "0"}, TypeError, r"broadcast_from must be a rank"),
        ({"process_group": "world"}, TypeError, r"process_group must be a torch.distributed.ProcessGroup"),
        ({"config": {"max_in_flight_allgathers": 2}}, TypeError, r"config must be a thunder_overlap.OverlapConfig"),
        ({"move_state_dict_to_cpu": "yes"}, TypeError, r"move_state_dict_to_cpu must be a bool"),
        ({"activation_checkpointing": "block"}, TypeError, r"activation_checkpointing must be a bool, got 'block'"),
    ],
)
def test_bad_fsdp_arguments(gloo_group, kwargs, error, message):
    with pytest.raises(error, match=message):
        thunder_overlap.fsdp(_model(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_strategy": "zero1"}, ValueError, r"sharding_strategy must be 'zero2', 'zero3' or 'auto' .*got 'zero1'"),
        ({"config": "fast"}, TypeError, r"config must be a thunder_overlap.OverlapConfig"),
        ({"move_state_dict_to_cpu": 1}, TypeError, r"move_state_dict_to_cpu must be a bool, got 1"),
    ],
)
def test_bad_plugin_arguments(gloo_group, kwargs, error, message):
    with pytest.raises(error, match=message):
        FSDPOverlap(**kwargs)


def test_model_must_be_a_module(gloo_group):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got function"):
        thunder_overlap.fsdp(lambda x: x)


def test_jit_options_are_refused_for_an_already_jitted_module(gloo_group):
    with pytest.raises(TypeError, match=r"options \['cache'\] are thunder.jit options"):
        thunder_overlap.fsdp(thunder.jit(_model()), jit_options={"cache": "no caching"})


def test_misspelled_keywords_are_refused_naming_the_accepted_ones(gloo_group):
    # They used to go to thunder.jit as compile options, which it accepts: ZeRO2, no buckets, no word.
    accepted = sorted(
        name for name, p in inspect.signature(thunder_overlap.fsdp).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
    )
    with pytest.raises(TypeError) as error:
        thunder_overlap.fsdp(_model(), sharding="zero3", bucketing="block", bucket_cap=25)
    message = str(error.value)
    assert message.startswith("fsdp() got unknown keyword arguments ['bucket_cap', 'bucketing', 'sharding']"), message
    guesses = "'bucket_cap' -> 'bucket_cap_mb', 'bucketing' -> 'bucketing_strategy', 'sharding' -> 'sharding_strategy'"
    assert f"(did you mean {guesses}?)" in message
    assert f"it accepts {accepted}" in message and "jit_options" in accepted
    assert message.endswith("options for thunder.jit go in jit_options={...}")


def test_thunder_jit_keywords_are_pointed_to_jit_options(gloo_group):
    with pytest.raises(TypeError, match=r"^options \['executors'\] are thunder.jit options: pass them as jit_options=\{\.\.\.\}$"):
        thunder_overlap.fsdp(_model(), executors=["torch"])
    with pytest.raises(TypeError, match=r"jit_options must be a dict of thunder.jit keywords or None, got \['torch'\]"):
        thunder_overlap.fsdp(_model(), jit_options=["torch"])


def test_jit_options_reach_thunder_jit(gloo_group):
    class Recorder(thunder.core.transform_common.Transform):
        def __init__(self):
            self.seen = []

        def transform_module(self, model):
            self.seen.append(type(model).__name__)

    recorder = Recorder()
    model = thunder_overlap.fsdp(_model(), jit_options={"transforms": [recorder], "disable_torch_autograd": False})
    assert recorder.seen == ["ThunderModule"]
    assert thunder.compile_data(model).transforms[0] is recorder


@pytest.mark.parametrize("entry", ["fsdp_transforms", "FSDPOverlap"])
def test_option_keywords_of_transforms_and_plugin_are_checked_by_name(gloo_group, entry):
    make = thunder_overlap.fsdp_transforms if entry == "fsdp_transforms" else FSDPOverlap
    with pytest.raises(TypeError) as error:
        make(process_group=gloo_group, sharding="zero3")
    assert str(error.value) == (
        f"{entry}() got unknown keyword arguments ['sharding'] (did you mean 'sharding' -> 'sharding_strategy'?); "
        f"it accepts {sorted(resolve_keywords())}"
    )


def test_a_model_cannot_be_sharded_twice(gloo_group):
    sharded = thunder_overlap.fsdp(thunder.jit(_model()))
    with pytest.raises(ValueError, match="already sharded"):
        thunder_overlap.fsdp(sharded)


_CONSUMED = r"already sharded with FSDP: an earlier thunder_overlap.fsdp consumed it: its parameters are one rank's shards"


def test_a_module_fsdp_consumed_is_refused_whatever_its_wrapper(gloo_group):
    # The first fsdp() made the parameters its shards; a second one would shard them again.
    model = _model()
    sharded = thunder_overlap.fsdp(model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in sharded.parameters()]
    with pytest.raises(ValueError, match=rf"^model is {_CONSUMED}.*pass the module that fsdp\(\) returned"):
        thunder_overlap.fsdp(model)
    with pytest.raises(ValueError, match=rf"^model is {_CONSUMED}"):
        thunder_overlap.fsdp(thunder.jit(model))
    with pytest.raises(ValueError, match=rf"^model's submodule 'body' is {_CONSUMED}"):
        thunder_overlap.fsdp(nn.ModuleDict({"body": model}))
    with pytest.raises(ValueError, match=rf"^model is {_CONSUMED}"):
        thunder.jit(model, transforms=thunder_overlap.fsdp_transforms(device="cpu", process_group=gloo_group))


def test_a_module_thunders_fsdp_consumed_is_refused(gloo_group):
    model = _model()
    thunder.distributed.fsdp(thunder.jit(model), device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^model is already sharded with FSDP: an earlier Thunder's FSDP consumed it"):
        thunder_overlap.fsdp(model)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.linear(x) * self.scale


class _NoParameters(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # Thunder said: "cannot deal with modules other than the compiled module".
        (_NoParameters, r"^model \(_NoParameters\) has no parameters: FSDP shards parameters, so there is nothing to shard$"),
        # Thunder said, at the first step: "Failed to find an executor for bound symbol ... synchronize".
        (
            lambda: _model().requires_grad_(False),
            r"^model \(Sequential\) has no trainable parameter: all 4 have requires_grad=False\..*unfreeze at least one parameter",
        ),
        # Thunder said: "IndexError: Dimension specified as 0 but tensor has no dimensions".
        (_Scaled, r"^model has 0-dim parameters \['scale'\]: .*make each a 1-element tensor .*or register it as a buffer"),
    ],
)
@pytest.mark.parametrize("entry", ["fsdp", "fsdp_transforms"])
def test_models_fsdp_cannot_shard_are_refused_before_thunder_runs(gloo_group, make, message, entry):
    model = make()
    with pytest.raises(ValueError, match=message):
        if entry == "fsdp":
            thunder_overlap.fsdp(model)
        else:
            thunder.jit(model, transforms=thunder_overlap.fsdp_transforms(device="cpu", process_group=gloo_group))
    assert not any(p.is_meta for p in model.parameters()), "a refused model must keep its parameters"


def test_strategies_accept_enums_and_case_insensitive_strings(gloo_group):
    model = thunder_overlap.fsdp(_model(), sharding_strategy="ZeRO3", bucketing_strategy=thunder.distributed.FSDPBucketingStrategy.NONE)
    assert any(isinstance(t, Zero3Transform) for t in thunder.compile_data(model).transforms)
    # An input that needs its gradient: the first layer's weight is read in the backward too, and
    # ZeRO3 keeps only the last layer's, which its backward needs first ([Note: ZeRO3 keeps what is free]).
    model(torch.ones(3, 4, requires_grad=True)).sum().backward()
    backward = thunder.last_backward_traces(model)[-1]
    assert schedule_stats(backward).allgathers > 0  # ZeRO3: the backward re-gathers parameters
    assert Zero3Transform.of(model).choice.kept == ("1",)


@pytest.mark.parametrize("sharding", ["zero3", "ZERO3", thunder.distributed.FSDPType.ZERO3, ShardingStrategy.ZERO3])
def test_fsdp_transforms_parse_strategies_like_fsdp(gloo_group, sharding):
    # It used to compare with `is FSDPType.ZERO3`, so the string "zero3" silently gave ZeRO2.
    transforms = thunder_overlap.fsdp_transforms(device="cpu", process_group=gloo_group, sharding_strategy=sharding)
    assert sum(isinstance(t, Zero3Transform) for t in transforms) == 1


@pytest.mark.parametrize("bucketing", ["block", "Layer", thunder.distributed.FSDPBucketingStrategy.BLOCK])
def test_fsdp_transforms_accept_bucketing_strategy_strings_and_enums(gloo_group, bucketing):
    transforms = thunder_overlap.fsdp_transforms(device="cpu", process_group=gloo_group, bucketing_strategy=bucketing)
    (bucketing_transform,) = [t for t in transforms if isinstance(t, BucketingTransform)]
    assert bucketing_transform.strategy is parse_bucketing_strategy(bucketing)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sharding_strategy": "zero4"}, ValueError, r"^sharding_strategy must be 'zero2', 'zero3' or 'auto' .*got 'zero4'$"),
        ({"bucketing_strategy": "flat"}, ValueError, r"^bucketing_strategy must be 'none', 'layer', 'block' or 'auto' .*got 'flat'$"),
        ({"device": "potato"}, ValueError, r"device='potato' is not a valid torch device"),
        (
            {"device": "cpu", "sharding_strategy": "auto"},
            ValueError,
            r"^sharding_strategy='auto' on device 'cpu' needs a memory budget: pass config=OverlapConfig\(memory_budget_bytes=\.\.\.\)",
        ),
        # fsdp_transforms used to take the cap in bytes; it now takes fsdp's bucket_cap_mb.
        ({"bucket_cap_bytes": 2**20}, TypeError, r"bucket_cap_bytes"),
    ],
)
def test_fsdp_transforms_validate_like_fsdp(gloo_group, kwargs, error, message):
    with pytest.raises(error, match=message):
        thunder_overlap.fsdp_transforms(process_group=gloo_group, **kwargs)


def test_options_object_or_keywords_not_both(gloo_group):
    options = FSDPOptions.resolve(device="cpu", process_group=gloo_group, sharding_strategy="zero3")
    with pytest.raises(TypeError, match=r"fsdp_transforms: pass either an FSDPOptions or keywords, not both .*'sharding_strategy'"):
        thunder_overlap.fsdp_transforms(options, sharding_strategy="zero2")
    with pytest.raises(TypeError, match=r"FSDPOverlap takes a thunder_overlap.FSDPOptions .*got 'cpu'; pass the other options by keyword"):
        FSDPOverlap("cpu")
    assert FSDPOverlap(options).options is options


def test_options_must_be_resolved(gloo_group):
    with pytest.raises(TypeError, match=r"FSDPOptions holds parsed strategies, got sharding='zero3'.*FSDPOptions.resolve"):
        FSDPOptions(
            device=torch.device("cpu"),
            process_group=gloo_group,
            sharding="zero3",
            bucketing=BucketingStrategy.NONE,
            bucket_cap_bytes=None,
            broadcast_from=None,
            config=OverlapConfig(),
            move_state_dict_to_cpu=False,
        )


def test_cli_flags_get_errors_in_cli_terms():
    with pytest.raises(ValueError, match=r"^--sharding must be zero2, zero3 or auto \(got 'zero4'\)$"):
        parse_sharding_strategy("zero4", flag="--sharding")
    with pytest.raises(ValueError, match=r"^--bucketing must be none, layer, block or auto \(got 'blocks'\)$"):
        parse_bucketing_strategy("blocks", flag="--bucketing")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"policy": "eager"},
            ValueError,
            r"policy must be one of \('memory_aware', 'heuristic', 'greedy', 'just_in_time', 'stock'\), got 'eager'",
        ),
        ({"max_in_flight_allgather_bytes": -1}, ValueError, r"OverlapConfig.max_in_flight_allgather_bytes must be an integer > 0, or None"),
        ({"max_in_flight_allgather_bytes": 1.5}, TypeError, r"max_in_flight_allgather_bytes must be an integer > 0, or None .*got 1.5"),
        ({"prefetch_blocks": 0}, ValueError, r"OverlapConfig.prefetch_blocks must be a number > 0, got 0"),
        ({"prefetch_blocks": "2"}, TypeError, r"prefetch_blocks must be a number > 0, got '2'"),
        ({"prefetch_blocks": NAN}, ValueError, r"prefetch_blocks must be a number > 0, got nan"),
        ({"prefetch_blocks": INF}, ValueError, r"prefetch_blocks must be a number > 0, got inf"),
        ({"reduce_in_pool": 1}, TypeError, r"reduce_in_pool must be a bool, got 1"),
        ({"memory_slack_bytes": None}, TypeError, r"memory_slack_bytes must be an integer >= 0, got None"),
        ({"memory_slack_ratio": -0.1}, ValueError, r"memory_slack_ratio must be a number >= 0, got -0.1"),
        ({"memory_budget_bytes": 0}, ValueError, r"memory_budget_bytes must be an integer > 0, or None \(no limit\), got 0"),
        ({"memory_budget_bytes": "60GiB"}, TypeError, r"memory_budget_bytes must be an integer > 0, or None \(no limit\), got '60GiB'"),
        (
            {"memory_budget_bytes": 1 << 30, "policy": "greedy"},
            ValueError,
            r"memory_budget_bytes=1073741824 needs a policy that reads memory \('memory_aware' or 'just_in_time'\); policy='greedy'",
        ),
        ({"memory_slack_ratio": INF}, ValueError, r"memory_slack_ratio must be a number >= 0, got inf"),
        ({"cost_model": "h100"}, TypeError, r"cost_model must be a thunder_overlap.CostModel or None, got 'h100'"),
        ({"_tuning": {"coalesce": False}}, TypeError, r"OverlapConfig._tuning must be a thunder_overlap.config.Tuning"),
    ],
)
def test_bad_config_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        OverlapConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_in_flight_allgathers": 0}, ValueError, r"^Tuning.max_in_flight_allgathers must be an integer > 0, or None .*, got 0$"),
        ({"max_in_flight_allgathers": 1.5}, TypeError, r"max_in_flight_allgathers must be an integer > 0, or None .*, got 1.5"),
        ({"max_in_flight_reduce_scatter_bytes": True}, TypeError, r"max_in_flight_reduce_scatter_bytes must be an integer > 0"),
        ({"bucket_eager_prefetch_blocks": 0}, ValueError, r"bucket_eager_prefetch_blocks must be a number > 0, or None .*, got 0"),
        ({"bucket_eager_prefetch_blocks": INF}, ValueError, r"bucket_eager_prefetch_blocks must be a number > 0, or None .*got inf"),
        ({"bucket_reduce_scatter_blocks": -1.0}, ValueError, r"bucket_reduce_scatter_blocks must be a number > 0, or None .*, got -1.0"),
        ({"bucket_reduce_scatter_blocks": NAN}, ValueError, r"bucket_reduce_scatter_blocks must be a number > 0, or None .*, got nan"),
        ({"bucket_reduce_scatter_blocks": INF}, ValueError, r"bucket_reduce_scatter_blocks must be a number > 0, or None .*, got inf"),
        ({"bucket_reduce_scatter_blocks": True}, TypeError, r"bucket_reduce_scatter_blocks must be a number > 0, or None .*, got True"),
        ({"check_ranks_agree": "yes"}, TypeError, r"check_ranks_agree must be a bool, got 'yes'"),
        ({"coalesce": 1}, TypeError, r"coalesce must be a bool, got 1"),
        ({"per_tensor_gather_max_slowdown": -0.1}, ValueError, r"per_tensor_gather_max_slowdown must be a number >= 0, or None .*-0.1"),
        ({"per_tensor_gather_max_slowdown": "1%"}, TypeError, r"per_tensor_gather_max_slowdown must be a number >= 0.*'1%'"),
        ({"per_tensor_gather_max_slowdown": NAN}, ValueError, r"per_tensor_gather_max_slowdown must be .*got nan"),
        ({"reduce_from_copy_max_slowdown": -1}, ValueError, r"reduce_from_copy_max_slowdown must be a number >= 0, or None .*got -1"),
        ({"reduce_from_copy_max_slowdown": True}, TypeError, r"reduce_from_copy_max_slowdown must be a number >= 0.*True"),
        ({"max_prefetch_compute_ops": -1}, ValueError, r"max_prefetch_compute_ops must be an integer >= 0, or None"),
        ({"prefetch_time_margin": 0}, ValueError, r"prefetch_time_margin must be a number > 0, or None"),
        ({"prefetch_time_margin": NAN}, ValueError, r"prefetch_time_margin must be a number > 0, or None .*got nan"),
        ({"fallback_in_flight_allgathers": None}, TypeError, r"fallback_in_flight_allgathers must be an integer > 0, got None"),
        ({"chained_wait_compute_ops": INF}, TypeError, r"chained_wait_compute_ops must be an integer >= 0, got inf"),
        ({"auto_bucket_latency_share": 1}, ValueError, r"auto_bucket_latency_share must be a number between 0 and 1, got 1"),
        ({"auto_bucket_latency_share": NAN}, ValueError, r"auto_bucket_latency_share must be a number between 0 and 1, got nan"),
    ],
)
def test_bad_tuning_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        Tuning(**kwargs)


def test_a_huge_prefetch_depth_means_no_limit_rather_than_an_overflow():
    limits = resolve_limits(OverlapConfig(prefetch_blocks=1e308), 1 << 20)
    assert limits.max_allgather_bytes >= 1 << 62


def test_no_sync_without_buckets_is_refused_instead_of_dropping_gradients(gloo_group):
    model = thunder_overlap.fsdp(_model())
    with thunder.distributed.skip_data_parallel_grad_sync():
        with pytest.raises(NotImplementedError, match=r"no_sync .*needs bucketing_strategy='layer', 'block' or 'auto' \(got 'none'\)"):
            model(torch.randn(3, 4)).sum().backward()
    # Outside it the model trains as usual.
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bucketing", ["none", "block"])
def test_freezing_or_unfreezing_after_fsdp_is_refused_naming_the_parameter(gloo_group, bucketing):
    model = thunder_overlap.fsdp(_model(), bucketing_strategy=bucketing)
    model.get_parameter("0.weight").requires_grad_(False)  # before the first call
    with pytest.raises(RuntimeError, match=r"^thunder_overlap: requires_grad changed after fsdp\(\) for '0\.weight' \(True -> False\)\. "):
        model(torch.randn(3, 4))
    model.get_parameter("0.weight").requires_grad_(True)
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # After a step too, and the other way round; the message says what to do.
    model.get_parameter("1.bias").requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"for '1\.bias' \(True -> False\)\. .*set requires_grad before thunder_overlap\.fsdp\(\)"):
        model(torch.randn(3, 4))
    frozen = _model()
    frozen[1].bias.requires_grad_(False)
    model = thunder_overlap.fsdp(frozen, bucketing_strategy=bucketing)
    model.get_parameter("1.bias").requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"for '1\.bias' \(False -> True\)"):
        model(torch.randn(3, 4))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _ReentrantStack(nn.Module):
    """Checkpoints its layers as transformers' ``gradient_checkpointing_enable()`` sets a model up:
    a ``functools.partial`` of torch's checkpoint, ``use_reentrant=True`` unless told otherwise."""

    def __init__(self, **checkpoint_kwargs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, **checkpoint_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self._gradient_checkpointing_func(layer.__call__, x)
        return x


def test_reentrant_gradient_checkpointing_is_refused_before_tracing(gloo_group):
    with pytest.raises(ValueError, match=r'gradient_checkpointing_kwargs=\{"use_reentrant": False\}'):
        thunder_overlap.fsdp(_ReentrantStack(use_reentrant=True))
    with pytest.raises(ValueError, match=r"checkpoints its layers with use_reentrant=True, transformers' default"):
        thunder_overlap.fsdp(_ReentrantStack())  # transformers' default: use_reentrant=True


def test_a_reentrant_checkpoint_met_while_tracing_says_what_to_pass(gloo_group):
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_Layer() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
            return x

    model = thunder_overlap.fsdp(Stack())
    # Thunder 0.2.6 itself fails here with "exceptions must derive from BaseException".
    with pytest.raises(ValueError, match=r"checkpoint\(_Layer, \.\.\., use_reentrant=True\): pass use_reentrant=False"):
        model(torch.randn(2, 4))


def test_the_non_reentrant_checkpoint_of_the_same_layers_trains(gloo_group):
    model = thunder_overlap.fsdp(_ReentrantStack(use_reentrant=False))
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_activation_checkpointing_without_blocks_is_refused(gloo_group):
    with pytest.raises(ValueError, match=r"activation_checkpointing=True: found no blocks in _Layer to checkpoint .*block_types="):
        thunder_overlap.fsdp(_Layer(), activation_checkpointing=True)
