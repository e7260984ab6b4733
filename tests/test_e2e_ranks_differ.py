"""Two gloo ranks whose batches differ in shape, as dynamic padding gives: each rank retraces at
its own steps. They must neither hang nor abort, and train exactly like one process whose loss
is the mean of the two ranks' losses (checked step by step against float64, within float32's
rounding: thunder_overlap.testing.parity). Ranks that would move different collectives raise a
clear error on every rank instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.float_error import OptimizerReplay, rounding_count
from thunder_overlap.testing.parity import RankSteps, check_steps

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
MODEL = TinyGPTConfig(n_layer=2, n_embd=32, n_head=2)
# For the errors raised at the first compile: settings, bucket plans and the first collective that
# differs are all compared within the first block, so a second one adds only tracing time.
ONE_BLOCK = replace(MODEL, n_layer=1)
# (batch size, sequence length) per step for each rank: each retraces at a step the other does
# not, and at the last step rank 1 runs a trace it compiled before while rank 0 compiles one.
PER_RANK_SEQUENCE_LENGTHS = {0: [(2, 8), (2, 8), (2, 4)], 1: [(2, 8), (2, 4), (2, 8)]}
PER_RANK_BATCH_SIZES = {0: [(1, 8), (1, 8), (3, 8)], 1: [(1, 8), (3, 8), (1, 8)]}
SCHEDULES = {"sequence lengths": PER_RANK_SEQUENCE_LENGTHS, "batch sizes": PER_RANK_BATCH_SIZES}
# Every sharding with every bucketing once, and each schedule under both shardings and both
# bucketings: the schedules differ only in which activation dimension changes (collectives are
# parameter-shaped), so crossing them covers what a full product would, in two fewer compiles.
RUNS = [
    ("sequence lengths", "zero2", "none"),
    ("sequence lengths", "zero3", "block"),
    ("batch sizes", "zero2", "block"),
    ("batch sizes", "zero3", "none"),
]
# AdamW with its default eps (1e-8): it divides each gradient by its running magnitude, so an
# element whose gradient is zero up to rounding (the attention key bias: softmax ignores a shift)
# takes a full step of either sign. The check compares each step from the ranks' own parameters
# (parity.check_steps), so that amplification never enters what it allows.
LR = 1e-2


def _batch(rank: int, step: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, MODEL.vocab_size, (shape[0], shape[1] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in parameters if p.requires_grad], lr=LR)


@dataclass
class RankRun:
    losses: list[float]
    # Local shards before each step and after the last; gradient shards of each step.
    params: list[dict[str, torch.Tensor]]
    grads: list[dict[str, torch.Tensor]]
    # Collectives in issue order in each pass of the last step ("kind dtype[shape]").
    issue_order: list[str]


def _issue_order(jm) -> list[str]:
    import thunder

    from thunder_overlap._analysis.classify import NodeKind, classify_trace

    order = []
    for trace in (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]):
        annotated = classify_trace(trace, roles_only=True)
        for node in annotated.nodes:
            if node.kind is NodeKind.COLLECTIVE:
                out = node.bsym.flat_proxy_outs[0]
                order.append(f"{node.name} {out.dtype}{list(out.shape)}")
    return order


def _train_every_config(rank: int, world_size: int) -> dict[tuple[str, str, str], RankRun]:
    import thunder_overlap

    runs = {}
    for schedule_name, sharding, bucketing in RUNS:
        schedule = SCHEDULES[schedule_name]
        torch.manual_seed(0)
        jm = thunder_overlap.fsdp(TinyGPT(MODEL), sharding_strategy=sharding, bucketing_strategy=bucketing)
        optimizer = _optimizer(jm.parameters())
        run = RankRun([], [_shards(jm)], [], [])
        for step, shape in enumerate(schedule[rank]):
            idx, targets = _batch(rank, step, shape)
            optimizer.zero_grad()
            loss = _loss(jm(idx), targets)
            loss.backward()
            optimizer.step()
            run.losses.append(loss.item())
            run.grads.append({name: p.grad.clone() for name, p in jm.named_parameters() if p.grad is not None})
            run.params.append(_shards(jm))
        run.issue_order = _issue_order(jm)
        runs[(schedule_name, sharding, bucketing)] = run
    return runs


def _shards(jm) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in jm.named_parameters()}


def _check(runs: list[RankRun], schedule: dict[int, list[tuple[int, int]]]):
    """Every step against one float64 process whose loss is the mean of the ranks' losses, which
    is what FSDP's averaged gradients descend (parity.check_steps)."""

    def loss_terms(model, step: int) -> list[torch.Tensor]:
        return [_loss(model(idx), targets) for idx, targets in (_batch(r, step, schedule[r][step]) for r in range(WORLD_SIZE))]

    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    shapes = [shape for shapes in schedule.values() for shape in shapes]
    tokens, seq_len = max(b * s for b, s in shapes), max(s for _, s in shapes)
    roundings = rounding_count(model.parameters(), tokens=tokens, seq_len=seq_len, world_size=WORLD_SIZE)
    ranks = [RankSteps(rank, run.params, run.grads) for rank, run in enumerate(runs)]
    return check_steps(ranks, model, loss_terms, lambda: OptimizerReplay("adamw", LR), roundings)


@pytest.fixture(scope="module")
def runs(local_ranks):
    return local_ranks(_train_every_config, WORLD_SIZE, (), timeout_s=900)


@pytest.mark.parametrize(("schedule_name", "sharding", "bucketing"), RUNS)
def test_ranks_with_different_shapes_train_like_one_process(runs, schedule_name, sharding, bucketing):
    ranks = [r[(schedule_name, sharding, bucketing)] for r in runs]
    check = _check(ranks, SCHEDULES[schedule_name])
    check.assert_mean_losses([r.losses for r in ranks])
    check.mismatches.assert_none()


@pytest.mark.parametrize(("schedule_name", "sharding", "bucketing"), RUNS)
def test_ranks_with_different_shapes_issue_one_order(runs, schedule_name, sharding, bucketing):
    # The last step has other shapes on each rank (rank 0: 4 tokens or 3 rows, rank 1: 8 and 1).
    orders = [r[(schedule_name, sharding, bucketing)].issue_order for r in runs]
    assert orders[0] and orders[0] == orders[1]


class _SkipsItsLastBlockOnRank1(TinyGPT):
    """The same parameters on every rank; rank 1's forward leaves the last block out, so its
    traces gather the other blocks only."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks[:-1] if dist.get_rank() == 1 else self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))


def _one_rank_moves_other_collectives(rank: int, world_size: int) -> str | None:
    import thunder_overlap

    torch.manual_seed(0)
    return _first_step_error(thunder_overlap.fsdp(_SkipsItsLastBlockOnRank1(MODEL), sharding_strategy="zero3"))


def _first_step_error(jm) -> str | None:
    """The RuntimeError a first forward raises on this rank, or None."""
    try:
        jm(torch.randint(0, MODEL.vocab_size, (1, 8)))
    except RuntimeError as e:
        return str(e)
    return None


def test_ranks_that_would_move_different_collectives_raise_on_every_rank(local_ranks):
    # A short timeout: a deadlock would fail this test instead of stalling CI.
    messages = local_ranks(_one_rank_moves_other_collectives, WORLD_SIZE, (), timeout_s=120)
    for message in messages:
        assert message is not None and "would hang" in message, messages
        assert "ranks [1]" in message and "rank 0 issues all_gather" in message and "which rank 1 does not" in message, message


class _SlowOnRank1:
    """A collective estimate as rank 1 might measure it: every collective very slow there, free on
    rank 0. Estimates are no setting the ranks compare (measured timings may differ)."""

    def __call__(self, collective) -> float:
        import torch.distributed as dist

        return 1e6 if dist.get_rank() == 1 else 0.0


def _ranks_with_different_estimates(rank: int, world_size: int) -> tuple[list[str], dict[str, bool]]:
    import thunder_overlap
    from thunder_overlap import OverlapConfig, OverlapScheduleTransform
    from thunder_overlap._analysis.cost_model import CostModel

    torch.manual_seed(0)
    # Rank 1 expects every collective to be slow, so on its own it would issue the ZeRO3
    # re-gathers earlier than rank 0 does: the two ranks would pair different collectives.
    config = OverlapConfig(cost_model=CostModel.named("cpu", "gloo-loopback", collective_estimate=_SlowOnRank1()))
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), sharding_strategy="zero3", config=config)
    idx, targets = _batch(rank, 0, (2, 8))
    _loss(jm(idx), targets).backward()
    return _issue_order(jm), OverlapScheduleTransform.of(jm).agreement.adopted


def test_ranks_whose_own_orders_differ_adopt_the_first_ranks_order(local_ranks):
    (order_0, adopted_0), (order_1, adopted_1) = local_ranks(_ranks_with_different_estimates, WORLD_SIZE, (), timeout_s=300)
    assert order_0 == order_1
    # Not vacuous: rank 1's own backward order was another one, and it gave it up.
    assert adopted_1["backward"] and not any(adopted_0.values())


# Settings one rank alone changes, and the field each makes differ; with the first three the
# ranks made a different number of exchanges at the first compile (a gloo abort, not an error).
OTHER_SETTINGS = {
    "policy": ({"config": {"policy": "just_in_time"}}, "policy: rank 0 'memory_aware', rank 1 'just_in_time'"),
    "reduce_in_pool": ({"config": {"reduce_in_pool": False}}, "reduce_in_pool: rank 0 True, rank 1 False"),
    "check_ranks_agree": ({"tuning": {"check_ranks_agree": False}}, "tuning.check_ranks_agree: rank 0 True, rank 1 False"),
    "per_tensor_gather_max_slowdown": (
        {"tuning": {"per_tensor_gather_max_slowdown": None}},
        "tuning.per_tensor_gather_max_slowdown: rank 0 0.01, rank 1 None",
    ),
}


def _ranks_given_other_settings(rank: int, world_size: int) -> dict[str, str | None]:
    import thunder_overlap
    from thunder_overlap import OverlapConfig
    from thunder_overlap.config import Tuning

    messages = {}
    for name, (change, _) in OTHER_SETTINGS.items():
        torch.manual_seed(0)
        config = OverlapConfig(**change.get("config", {}), _tuning=Tuning(**change.get("tuning", {}))) if rank == 1 else None
        jm = thunder_overlap.fsdp(TinyGPT(ONE_BLOCK), sharding_strategy="zero3", bucketing_strategy="block", config=config)
        messages[name] = _first_step_error(jm)
    return messages


def test_ranks_given_other_settings_raise_naming_the_fields(local_ranks):
    # Compared before any other exchange, so every rank raises the same error, naming the field.
    ranks = local_ranks(_ranks_given_other_settings, WORLD_SIZE, (), timeout_s=300)
    for name, (_, named) in OTHER_SETTINGS.items():
        for messages in ranks:
            message = messages[name]
            assert message is not None and "rank 1 of the process group was given other settings than rank 0" in message, (name, message)
            assert named in message, (name, message)


def _one_rank_caps_its_buckets_differently(rank: int, world_size: int) -> str | None:
    import thunder_overlap

    torch.manual_seed(0)
    # Rank 1 alone caps its buckets: its plan (and its collectives) differ from rank 0's.
    cap = None if rank == 0 else 0.05
    jm = thunder_overlap.fsdp(TinyGPT(ONE_BLOCK), sharding_strategy="zero3", bucketing_strategy="auto", bucket_cap_mb=cap)
    return _first_step_error(jm)


def test_ranks_given_other_bucket_caps_raise_on_every_rank(local_ranks):
    messages = local_ranks(_one_rank_caps_its_buckets_differently, WORLD_SIZE, (), timeout_s=120)
    for message in messages:
        # The cap that made the plans differ is named, with both values.
        assert message is not None and "rank 1 of the process group was given other settings than rank 0" in message, messages
        assert "bucket_cap_bytes: rank 0 None, rank 1 52428" in message, message


def _one_rank_estimates_other_buckets(rank: int, world_size: int) -> str | None:
    import thunder_overlap
    from thunder_overlap import OverlapConfig
    from thunder_overlap._analysis.cost_model import CostModel
    from thunder_overlap._analysis.network import NetworkProfile

    torch.manual_seed(0)
    # The same settings, but rank 1's cost model sees a network with no latency, where every
    # parameter saturates the link alone: its auto plan (and its collectives) differ from rank 0's.
    network = "gloo-loopback" if rank == 0 else NetworkProfile("instant", 1e-9, 1e12)
    config = OverlapConfig(cost_model=CostModel.named("cpu", network))
    jm = thunder_overlap.fsdp(TinyGPT(ONE_BLOCK), sharding_strategy="zero3", bucketing_strategy="auto", config=config)
    return _first_step_error(jm)


def test_ranks_whose_cost_models_plan_other_buckets_raise_on_every_rank(local_ranks):
    messages = local_ranks(_one_rank_estimates_other_buckets, WORLD_SIZE, (), timeout_s=120)
    for message in messages:
        assert message is not None and "ranks [1] of the process group planned other buckets than rank 0" in message, messages
        assert "bucket_cap_mb" in message and "summaries.plan" in message, message


def _one_rank_plans_other_buckets(rank: int, world_size: int) -> str | None:
    import thunder_overlap

    torch.manual_seed(0)
    model = TinyGPT(ONE_BLOCK)
    if rank == 1:  # the same options, another model: its frozen final norm makes a bucket of its own
        model.norm_f.requires_grad_(False)
    return _first_step_error(thunder_overlap.fsdp(model, sharding_strategy="zero3", bucketing_strategy="block"))


def test_ranks_with_the_same_settings_but_other_bucket_plans_raise_on_every_rank(local_ranks):
    messages = local_ranks(_one_rank_plans_other_buckets, WORLD_SIZE, (), timeout_s=120)
    for message in messages:
        assert message is not None and "ranks [1] of the process group planned other buckets than rank 0" in message, messages
        assert "summaries.plan" in message, message


def _ranks_built_under_other_seeds(rank: int, world_size: int) -> dict[str, str | None]:
    """fsdp() of a model each rank built under its own seed, on the CPU and on the meta device, then
    with broadcast_from=0; and of the same model with the same seed."""
    import thunder_overlap

    def error_of(seed: int, **options) -> str | None:
        torch.manual_seed(seed)
        try:
            thunder_overlap.fsdp(TinyGPT(ONE_BLOCK), **options)
        except ValueError as error:
            return str(error)
        return None

    def error_on_meta(seed: int) -> str | None:
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = TinyGPT(ONE_BLOCK)
        try:
            thunder_overlap.fsdp(model, device="cpu")
        except ValueError as error:
            return str(error)
        return None

    def error_of_another_width() -> str | None:
        torch.manual_seed(0)
        try:
            thunder_overlap.fsdp(TinyGPT(replace(ONE_BLOCK, n_embd=32 + 16 * rank)))
        except ValueError as error:
            return str(error)
        return None

    return {
        "seeds": error_of(rank),
        "meta": error_on_meta(rank),
        "width": error_of_another_width(),
        "broadcast": error_of(rank, broadcast_from=0),
        "same seed": error_of(0),
    }


def test_ranks_whose_initial_weights_differ_raise_on_every_rank_naming_the_first_parameter(local_ranks):
    for errors in local_ranks(_ranks_built_under_other_seeds, WORLD_SIZE, (), timeout_s=120):
        assert errors["seeds"] is not None and errors["seeds"].startswith(
            "thunder_overlap.fsdp: ranks [1] differ from rank 0 in parameter 'wte.weight' before sharding"
        ), errors
        assert "broadcast_from=0" in errors["seeds"] and "torch.manual_seed" in errors["seeds"]
        # On the meta device the weights do not exist yet: their generator is compared.
        assert errors["meta"] is not None and "ranks [1] differ from rank 0 in the random generator's state" in errors["meta"], errors
        assert errors["width"] == (
            "thunder_overlap.fsdp: the ranks built different models: parameter 'wte.weight' "
            "(rank 0: [101, 32] torch.float32, rank 1: [101, 48] torch.float32); every rank must shard the same model"
        ), errors
        assert errors["broadcast"] is None and errors["same seed"] is None, errors


def _agree_on_prefixes(rank: int, world_size: int) -> list:
    from thunder_overlap._scheduling.rank_agreement import agreed_prefix, ranks_where

    group = torch.distributed.group.WORLD
    return [
        agreed_prefix(["a", "b", "c"][: 3 - rank], group),  # rank 1 has room for less
        agreed_prefix(["a", "b"], group),
        agreed_prefix(None if rank == 1 else ["a"], group),
        ranks_where(rank == 1, group),
    ]


def test_ranks_agree_on_the_prefix_all_chose_and_say_whether_they_all_chose_it(local_ranks):
    from thunder_overlap._scheduling.rank_agreement import PrefixAgreement

    for results in local_ranks(_agree_on_prefixes, WORLD_SIZE, (), timeout_s=60):
        assert results == [
            PrefixAgreement(("a", "b"), [], unanimous=False),
            PrefixAgreement(("a", "b"), [], unanimous=True),
            PrefixAgreement(("a",), [1], unanimous=False),
            [1],
        ]
