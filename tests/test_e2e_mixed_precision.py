"""Two gloo ranks train with bf16 gathers and fp32 reductions, with thunder_overlap and with FSDP2
(``fully_shard`` per block and at the root, with ``MixedPrecisionPolicy(bfloat16, float32)``), on
the same model and data: TinyGPT with ZeRO2 and ZeRO3 without buckets and ZeRO3 with block
buckets, and a two-layer litgpt Llama with ZeRO3 and block buckets, also with activation
checkpointing (FSDP2 without: recomputing computes the same).

The two compute in bf16 with different kernels (Thunder's decompositions against eager PyTorch)
and FSDP2 casts activations at each block's input, so their results agree to bf16's precision,
not bit for bit: per-step losses within 2e-2 relative, final fp32 parameters within 2e-2
(measured: TinyGPT 1.0e-4 and 1.5e-3, with or without buckets; Llama 4.7e-4 and 1.4e-3). On
models this small float32 training lands as close to FSDP2's bf16 losses, so the losses show that
the casts do no harm; that they happen is checked on the traces (every all-gather bf16, every
reduce-scatter fp32) here and in tests/test_mixed_precision_fake_group.py (half the all-gather
bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
# Vocabulary 101 pads on 2 ranks; TinyGPT ties its head to its embedding and freezes wpe.
MODEL = TinyGPTConfig(n_layer=2, n_embd=32, vocab_size=101)
STEPS, LR, MICRO_BATCH, SEQ_LEN = 6, 1.0, 2, 16
TOLERANCE = 2e-2
# (model, sharding, bucketing[, activation checkpointing]) of each thunder_overlap run, by its key in a session's results;
# each is compared with FSDP2 on the same model. litgpt's Llama casts back with .to(x.dtype) in
# RMSNorm and RoPE, which the matmuls after them downcast ([Note: mixed precision]).
CONFIGS = {
    "zero2-none": ("tinygpt", "zero2", "none"),
    "zero3-none": ("tinygpt", "zero3", "none"),
    "zero3-block": ("tinygpt", "zero3", "block"),
    "llama-zero3-block": ("llama", "zero3", "block"),
    "llama-zero3-block-checkpointed": ("llama", "zero3", "block", True),
}


def _model(name: str) -> torch.nn.Module:
    if name == "tinygpt":
        return TinyGPT(MODEL)
    from litgpt import GPT, Config

    config = Config.from_name(
        "Llama-2-7b-hf", n_layer=2, n_embd=32, n_head=4, n_query_groups=4, intermediate_size=64, vocab_size=101, padded_vocab_size=101
    )
    return GPT(replace(config, block_size=SEQ_LEN))


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.blocks if isinstance(model, TinyGPT) else model.transformer.h


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Two batches in turn: the model learns them, so the losses move well past the tolerance.
    generator = torch.Generator().manual_seed(1000 + step % 2)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO_BATCH * WORLD_SIZE, SEQ_LEN + 1), generator=generator)
    rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    return tokens[rows, :-1], tokens[rows, 1:]


def _train(model, rank: int) -> list[float]:
    return _train_on(model, [_batch(step, rank) for step in range(STEPS)])


def _train_on(model, batches) -> list[float]:
    """SGD steps, one per (tokens, targets) batch; the loss of each."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for idx, targets in batches:
        logits = model(idx).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _thunder_overlap_run(rank: int, model: str, sharding: str, bucketing: str, checkpointing: bool = False) -> dict:
    import thunder

    import thunder_overlap
    from thunder_overlap._analysis.classify import CollectiveKind, classify_trace
    from thunder_overlap._transforms import BucketingTransform

    torch.manual_seed(0)
    policy = thunder_overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    jm = thunder_overlap.fsdp(
        _model(model),
        device="cpu",
        sharding_strategy=sharding,
        bucketing_strategy=bucketing,
        mixed_precision=policy,
        activation_checkpointing=checkpointing,
    )
    buckets = BucketingTransform.of(jm)
    losses = _train(jm, rank)
    traces = (thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1])
    layouts = buckets.layouts if buckets is not None else {}
    collectives = [c for trace in traces for c in classify_trace(trace, layouts=layouts).collectives]
    run = {
        "losses": losses,
        "shards": {n: p.detach().clone() for n, p in jm.named_parameters()},
        "dtypes": {str(p.dtype) for p in jm.parameters()},
        "gather_dtypes": {str(c.dtype) for c in collectives if c.kind is CollectiveKind.ALL_GATHER},
        "reduce_dtypes": {str(c.dtype) for c in collectives if c.kind is CollectiveKind.REDUCE_SCATTER},
    }
    if buckets is not None:
        summaries = buckets.summaries
        run["unbucketed"] = summaries.forward.unbucketed + summaries.backward.unbucketed
        run["bucketed_gathers"] = summaries.forward.all_gathers + summaries.backward.all_gathers
        run["pool"] = (buckets.allocations, buckets.pool.slots)
        run["planned_pool"] = buckets.slot_plan(jm).slots
        # One step more: the buffers of the first are reused, nothing is allocated.
        _train_one_more_step(jm, rank)
        run["pool_after_another_step"] = (buckets.allocations, buckets.pool.slots)
    return run


def _train_one_more_step(model, rank: int) -> None:
    idx, targets = _batch(0, rank)
    logits = model(idx).float()
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()


def _fsdp2_run(rank: int, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _model(name)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    losses = _train(model, rank)
    # full_tensor() is a collective: every rank calls it for every parameter, in the same order.
    return {"losses": losses, "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


def _compare_session(rank: int, world_size: int) -> dict:
    assert world_size == WORLD_SIZE
    fsdp2 = {f"fsdp2-{name}": _fsdp2_run(rank, name) for name in sorted({config[0] for config in CONFIGS.values()})}
    return {**fsdp2, **{key: _thunder_overlap_run(rank, *config) for key, config in CONFIGS.items()}}


@pytest.fixture(scope="module")
def sessions(local_ranks):
    return local_ranks(_compare_session, WORLD_SIZE, (), timeout_s=900)


def _shard_of(full: torch.Tensor, rank: int) -> tuple[torch.Tensor, int]:
    chunk = -(-full.shape[0] // WORLD_SIZE)
    real = full[min(rank * chunk, full.shape[0]) :][:chunk]
    return real, real.shape[0]


@pytest.mark.parametrize("config", CONFIGS)
def test_losses_follow_fsdp2_with_the_same_policy(sessions, config):
    for session in sessions:
        ours, theirs = session[config]["losses"], session[f"fsdp2-{CONFIGS[config][0]}"]["losses"]
        relative = [abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)]
        assert max(relative) <= TOLERANCE, (ours, theirs)
        # Training happened: the first and last losses differ by more than the tolerance.
        assert abs(theirs[-1] - theirs[0]) / theirs[0] > TOLERANCE, theirs


@pytest.mark.parametrize("config", CONFIGS)
def test_final_float32_parameters_follow_fsdp2(sessions, config):
    for rank, session in enumerate(sessions):
        ours, theirs = session[config], session[f"fsdp2-{CONFIGS[config][0]}"]
        assert ours["dtypes"] == {"torch.float32"}
        assert set(ours["shards"]) == set(theirs["full"])
        for name, full in theirs["full"].items():
            expected, rows = _shard_of(full, rank)
            assert full.dtype is torch.float32
            torch.testing.assert_close(ours["shards"][name][:rows], expected, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


@pytest.mark.parametrize("config", CONFIGS)
def test_gathers_move_bf16_and_reductions_fp32(sessions, config):
    for session in sessions:
        assert session[config]["gather_dtypes"] == {"thunder.dtypes.bfloat16"}
        assert session[config]["reduce_dtypes"] == {"thunder.dtypes.float32"}


@pytest.mark.parametrize("config", ["zero3-block", "llama-zero3-block", "llama-zero3-block-checkpointed"])
def test_buckets_gather_every_parameter_in_bf16_from_buffers_allocated_once(sessions, config):
    for session in sessions:
        run = session[config]
        assert run["unbucketed"] == [] and run["bucketed_gathers"] > 0
        allocations, slots = run["pool"]
        assert {slot.dtype for slot in slots if "all-gather" in " ".join(slot.users)} == {"torch.bfloat16"}
        # Planned from the final traces: the same buffers as ran, serving the same uses; none added
        # by a later step.
        planned = run["planned_pool"]
        assert Counter((s.numel, s.dtype) for s in planned) == Counter((s.numel, s.dtype) for s in slots)
        assert sorted(s.users for s in planned) == sorted(s.users for s in slots)
        assert run["pool_after_another_step"] == (allocations, slots)


def _ranks_given_other_policies(rank: int, world_size: int) -> str | None:
    import thunder_overlap

    torch.manual_seed(0)
    policy = thunder_overlap.MixedPrecision(param_dtype=torch.bfloat16) if rank == 1 else None
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", mixed_precision=policy)
    try:
        jm(_batch(0, rank)[0])
    except RuntimeError as error:
        return str(error)
    return None


def test_ranks_given_other_policies_raise_naming_them(local_ranks):
    # Their all-gathers would move other dtypes and byte counts: the ranks compare their settings
    # at the first compile, before any collective of the step.
    messages = local_ranks(_ranks_given_other_policies, WORLD_SIZE, (), timeout_s=120)
    named = (
        "mixed_precision: rank 0 MixedPrecision(param_dtype=None, reduce_dtype=None), "
        "rank 1 MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None)"
    )
    for message in messages:
        assert message is not None and "rank 1 of the process group was given other settings than rank 0" in message, message
        assert named in message, message


# --- hybrid sharding (HSDP): 4 ranks, 2 replicas of shard groups of 2 -------------------------

HSDP_WORLD_SIZE, HSDP_MESH = 4, (2, 2)


def _hsdp_session(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import thunder_overlap

    assert world_size == HSDP_WORLD_SIZE
    # Each rank trains on its own rows: the same split as a 4-rank data-parallel run.
    batches = [_batch(step, rank % WORLD_SIZE) for step in range(STEPS)]
    if rank >= WORLD_SIZE:
        batches = [(idx.flip(0), targets.flip(0)) for idx, targets in batches]

    torch.manual_seed(0)
    model = _model("tinygpt")
    mesh = init_device_mesh("cpu", HSDP_MESH, mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    theirs = _train_on(model, batches)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(
        _model("tinygpt"),
        device="cpu",
        sharding_strategy="zero3",
        bucketing_strategy="block",
        device_mesh=init_device_mesh("cpu", HSDP_MESH),
        mixed_precision=thunder_overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    ours = _train_on(jm, batches)
    shards = {n: p.detach().clone() for n, p in jm.named_parameters()}
    return {"fsdp2": {"losses": theirs, "full": full}, "ours": {"losses": ours, "shards": shards}}


def test_hybrid_sharding_follows_fsdp2_hsdp_with_the_same_policy(local_ranks):
    sessions = local_ranks(_hsdp_session, HSDP_WORLD_SIZE, (), timeout_s=900)
    for rank, session in enumerate(sessions):
        ours, theirs = session["ours"], session["fsdp2"]
        relative = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
        assert max(relative) <= TOLERANCE, (ours["losses"], theirs["losses"])
        for name, full in theirs["full"].items():
            # Rank r holds shard r % 2 of its replica: the same rows as rank r % 2 of a 2-rank run.
            expected, rows = _shard_of(full, rank % WORLD_SIZE)
            torch.testing.assert_close(ours["shards"][name][:rows], expected, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
