"""Bucketing (layer, block and auto) on two gloo ranks: parity with a float64 single process, one
collective per bucket, nothing allocated or copied beyond one copy per bucket and direction after
the first step, and every user-facing feature (accumulation, zero_grad modes, state dicts,
retracing) behaving as without buckets. Plans and one-rank dtypes: tests/test_bucketing_one_rank.py."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from thunder_overlap._analysis.layout import ReducePath
from thunder_overlap.config import OverlapConfig, Tuning
from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.bucket_census import expected_plan
from thunder_overlap.testing.training import TrainSetup, check_against_reference, train_rank

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
MODEL = TinyGPTConfig(n_layer=2)
# Auto buckets (sized by the CPU's gloo cost model: wte, the first block, the second block with
# the final norm) once, with ZeRO3, whose backward re-gathers them too.
# ":as_on_nccl" runs the buckets as on NCCL (parameters gathered in place, no copy-out; unpadded
# gradients sent where they are, no lay-out), which gloo otherwise does not.
AS_ON_NCCL = ":as_on_nccl"
CASES = [(sharding, bucketing) for sharding in ("zero2", "zero3") for bucketing in ("layer", "block")] + [
    ("zero3", "auto"),
    ("zero3", "block" + AS_ON_NCCL),
]


# --- two ranks ----------------------------------------------------------------------------------


class _Runs(dict):
    """(sharding, bucketing) -> (ranks, their check against a float64 reference), each case
    run on first use only, so that selecting one case (-k) runs one."""

    def __init__(self, local_ranks) -> None:
        super().__init__()
        self.local_ranks = local_ranks

    def __missing__(self, case: tuple[str, str]):
        sharding, bucketing = case
        strategy, as_on_nccl = bucketing.removesuffix(AS_ON_NCCL), bucketing.endswith(AS_ON_NCCL)
        setup = TrainSetup(sharding=sharding, bucketing=strategy, model=MODEL, steps=3, measure_memory=False, buckets_as_on_nccl=as_on_nccl)
        ranks = self.local_ranks(train_rank, WORLD_SIZE, (setup,))
        self[case] = (ranks, check_against_reference(setup, WORLD_SIZE, ranks))
        return self[case]


@pytest.fixture(scope="module")
def runs(local_ranks):
    return _Runs(local_ranks)


@pytest.mark.parametrize(("sharding", "bucketing"), CASES)
def test_bucketed_training_matches_single_process_reference(runs, sharding, bucketing):
    ranks, check = runs[sharding, bucketing]
    check.assert_mean_losses([r.losses for r in ranks])
    # Every step, rank, parameter and element against float64, within float32's rounding bounds.
    check.mismatches.assert_none()


@pytest.mark.parametrize(("sharding", "bucketing"), CASES)
def test_one_collective_per_bucket_in_the_final_traces(runs, sharding, bucketing):
    ranks, _ = runs[sharding, bucketing]
    census = ranks[0].bucket_census
    names = [c.split("(")[0] for c in ranks[0].collectives]
    # Every collective is bucketed: nothing per-parameter is left. Buckets issued back to back may
    # go out as one coalesced launch of buckets, with one wait.
    bucketed = {"bucket_all_gather", "bucket_all_gather_wait", "bucket_reduce_scatter", "bucket_reduce_scatter_wait"}
    assert set(names) <= bucketed | {"coalesced_bucket_all_gather", "coalesced_bucket_reduce_scatter", "coalesced_wait"}
    trainable = census.buckets - census.frozen_buckets
    assert census.forward_all_gathers == census.buckets  # the model reads every parameter
    assert census.reduce_scatters == trainable
    stats = [ranks[0].forward_stats, ranks[0].backward_stats]
    # schedule_stats counts each member of a coalesced launch.
    assert sum(s.reduce_scatters for s in stats) == trainable
    assert sum(s.allgathers for s in stats) == census.forward_all_gathers + census.backward_all_gathers
    launches = sum(s.coalesced_launches for s in stats)
    assert names.count("coalesced_wait") == launches
    assert names.count("bucket_reduce_scatter") == names.count("bucket_reduce_scatter_wait")
    assert names.count("bucket_all_gather") == names.count("bucket_all_gather_wait")
    if sharding == "zero3":
        # Re-gathered: every trainable bucket but the position embedding's is read by backward.
        assert 0 < census.backward_all_gathers <= trainable
    else:
        assert census.backward_all_gathers == 0
    assert all(r.collectives == ranks[0].collectives for r in ranks)


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_block_buckets_issued_together_go_out_as_one_coalesced_launch(runs, sharding):
    # The forward issues the first blocks' buckets back to back; over gloo on a CPU latency
    # dominates such small buckets, so the cost model coalesces them (numerics: the test above).
    result = runs[sharding, "block"][0][0]
    assert result.forward_stats.coalesced_launches >= 1
    names = [c.split("(")[0] for c in result.collectives]
    assert "coalesced_bucket_all_gather" in names
    assert names.count("coalesced_wait") == result.forward_stats.coalesced_launches + result.backward_stats.coalesced_launches


def test_auto_buckets_on_two_gloo_ranks_follow_the_cost_model_and_run_where_faster_than_blocks(runs):
    census = runs["zero3", "auto"][0][0].bucket_census
    # gloo on a CPU pays 50 us per launch at 1 GB/s and runs two launches at once, so a bucket
    # saturates once its transfer outlasts most of a latency: ~90 KB unsharded. wte (93 KB)
    # saturates alone, so does blocks.0; blocks.1 takes norm_f (too small alone); the frozen wpe
    # goes on its own. One latency at a time (one lane) would merge them up to ~0.9 MB.
    choice = census.plan_choice
    assert choice is not None and choice.chosen == expected_plan(choice)
    auto = choice.not_run if choice.chosen == "block" else None
    if auto is not None:
        assert len(auto.buckets) == 4 and sum("frozen" in b.label for b in auto.buckets) == 1, auto
        assert all(b.unsharded_bytes > 90_000 for b in auto.buckets if "frozen" not in b.label)
    else:
        assert census.buckets == 4 and census.frozen_buckets == 1
        assert census.reduce_scatters == 3
        assert sorted(census.bucket_numels)[1] * 4 > 90_000  # every trainable bucket saturates
    # The ranks agreed: both ran the same buckets, and trained like the reference (above).
    ranks = runs["zero3", "auto"][0]
    assert len({tuple(r.bucket_census.bucket_numels) for r in ranks}) == 1


@pytest.mark.parametrize(("sharding", "bucketing"), CASES)
def test_steady_state_step_allocates_only_gradient_shards_and_copies_at_most_once_per_bucket_and_direction(runs, sharding, bucketing):
    census = runs[sharding, bucketing][0][0].bucket_census
    assert census.allocations_after_last_step == census.allocations_after_first_step
    assert census.bucket_allocations == 0
    # The one allocation per bucket: its gradient shard, as the gradient of an unbucketed
    # reduce-scatter is (given back between steps by zero_grad); rows of the pool allocate none.
    trainable = census.buckets - census.frozen_buckets
    assert census.gradient_shard_allocations == trainable - len(census.reduced_in_pool)
    copies = dict(census.bucket_copies)
    # Copy-out after a gather: one per multi-parameter bucket and gather (single ones are views),
    # but those gathered per tensor (over gloo, where the pool would otherwise hold a buffer the
    # step can spare); as on NCCL none, each parameter is gathered into its place.
    # ZeRO3 gathers each bucket again in the backward, but those it kept from the forward.
    copying_out = [label for label in census.multi_parameter_labels if label not in census.per_tensor_gathers]
    regathered = [label for label in copying_out if label not in census.kept_buckets] if sharding == "zero3" else []
    assert not census.kept_buckets if sharding == "zero2" else census.kept_buckets
    copied_out = 0 if bucketing.endswith(AS_ON_NCCL) else len(copying_out) + len(regathered)
    assert copies.pop("split_with_sizes_copy", 0) == copied_out
    # Copy-in before a reduce-scatter: one per bucket that lays its gradients out (over gloo all
    # of several tensors; as on NCCL, only the odd-sized embedding's, which needs padding, and
    # those reducing in the pool); the others send each gradient where it is.
    if bucketing.endswith(AS_ON_NCCL):
        assert census.laid_out_buckets == len({"wte", *census.reduced_in_pool})
        assert not census.per_tensor_gathers  # nothing left to choose
    else:  # over gloo every bucket here lays out: several tensors, or the padded embedding
        assert census.laid_out_buckets == census.reduce_scatters
    assert copies.pop("_chunk_cat") == census.laid_out_buckets
    # ZeRO2 leaves every gathered buffer idle once its block's backward is done: every
    # reduce-scatter reduces in place there. ZeRO3 re-gathers to the end: the last ones can
    # (with two blocks, all of them; see test_zero3_reduces_in_the_pool_only_at_the_end).
    if sharding == "zero2":
        assert len(census.reduced_in_pool) == census.reduce_scatters
    else:
        assert census.reduced_in_pool
    # Whatever is left: the row a bucket all-reduced in place copies out (gloo; not where its
    # row is its gradient shard, in the pool), and the process group's own copy inside each
    # reduce_scatter_tensor.
    copied_rows = census.reduced_in_place - (0 if bucketing.endswith(AS_ON_NCCL) else len(census.reduced_in_pool))
    row_copies = copied_rows + census.backend_copies_per_reduce_scatter * census.reduce_scatter_calls
    assert copies == ({"copy_": row_copies} if row_copies else {})
    if not bucketing.endswith(AS_ON_NCCL):  # over gloo, only those chosen reduce-scatter gloo's copy
        assert census.reduced_in_place == census.laid_out_buckets - len(census.reduces_from_copy)
    # ZeRO3's last block hands its lay-outs to gloo's copy: held to their waits, they would take
    # a third buffer beside the next block's parameters and their gather (the first block's
    # reduce in the pool). ZeRO2's lay-outs reuse the buffers of blocks whose backward is done;
    # in auto's buckets no lay-out held to its wait grows the pool. With layer buckets ZeRO3 keeps
    # the head, the final norm and the last layer from the forward ([Note: ZeRO3 keeps what is
    # free]): the final norm's lay-out and the last block's but one, as the estimator places them.
    last = f"blocks.{MODEL.n_layer - 1}"
    expected_from_copy = {
        ("zero3", "block"): {last},
        ("zero3", "layer"): {"norm_f"} | {f"{last}.{layer}" for layer in ("attn.qkv", "attn.proj", "norm_1", "fc", "proj")},
    }
    # "auto" runs block buckets where it predicts them faster ([Note: auto against block]).
    ran = "block" if census.plan_choice is not None and census.plan_choice.chosen == "block" else bucketing
    assert set(census.reduces_from_copy) == expected_from_copy.get((sharding, ran), set())
    assert census.pads == 0
    assert census.grads_are_bucket_views


DEEP = TinyGPTConfig(n_layer=3)


@pytest.fixture(scope="module")
def deep_runs(local_ranks):
    """Block buckets on a model deeper than the prefetch window (2 blocks)."""
    setups = {s: TrainSetup(sharding=s, bucketing="block", model=DEEP, steps=2, measure_memory=False) for s in ("zero2", "zero3")}
    # ZeRO3 with every bucket copied out over gloo (none gathered per parameter): how gathers,
    # copy-outs and lay-outs share the pool's buffers (those that would grow the pool handed to
    # gloo's copy at the launch).
    laid_out = OverlapConfig(_tuning=Tuning(per_tensor_gather_max_slowdown=None))
    setups["zero3"] = replace(setups["zero3"], config=laid_out)
    two_ahead = replace(laid_out, _tuning=replace(laid_out.tuning, bucket_eager_prefetch_blocks=None))
    setups["zero3, two blocks ahead"] = replace(setups["zero3"], config=two_ahead)
    setups["zero3, as on NCCL"] = replace(setups["zero3"], buckets_as_on_nccl=True)
    return {s: local_ranks(train_rank, WORLD_SIZE, (setup,))[0].bucket_census for s, setup in setups.items()}


def _split_use(use: str) -> tuple[str, str]:
    """A pool buffer's use, "<bucket label> <purpose>", split (labels may hold spaces)."""
    for purpose in ("reduce-scatter in place", "reduce-scatter", "all-gather", "copy-out"):
        if use.endswith(" " + purpose):
            return use.removesuffix(" " + purpose), purpose
    raise AssertionError(f"unknown pool use {use!r}")


def test_zero3_pool_holds_only_what_is_alive_at_once(deep_runs):
    n_blocks = DEEP.n_layer
    block_numel = max(deep_runs["zero3"].bucket_numels)
    assert deep_runs["zero3"].bucket_numels.count(block_numel) == n_blocks
    # The pool says what used each buffer: the block buffers serve gathers, copy-outs and
    # reduce-scatters of several blocks each, which is how fewer buffers than uses suffice.
    users = deep_runs["zero3"].pool_users
    assert len(users) == sum(deep_runs["zero3"].pool_buffers.values())
    uses = {_split_use(use)[1] for slot in users for use in slot}
    assert uses == {"all-gather", "copy-out", "reduce-scatter", "reduce-scatter in place"}
    assert any(len({_split_use(use)[0] for use in slot}) > 1 for slot in users)
    purposes = [{_split_use(use)[1].removesuffix(" in place") for use in slot} for slot in users]
    assert any({"all-gather", "reduce-scatter"} <= slot for slot in purposes)
    # Reduced in place in the pool: ZeRO2 every bucket, in the buffer its gather left idle;
    # ZeRO3 only the last ones, once no gather ahead needs the buffer.
    for name in ("zero2", "zero3"):
        split = [_split_use(use) for slot in deep_runs[name].pool_users for use in slot]
        in_pool = {label for label, purpose in split if purpose.endswith(" in place")}
        assert in_pool == set(deep_runs[name].reduced_in_pool), name
    assert len(deep_runs["zero2"].reduced_in_pool) == deep_runs["zero2"].reduce_scatters
    assert 0 < len(deep_runs["zero3"].reduced_in_pool) < deep_runs["zero3"].reduce_scatters
    # ZeRO2 keeps every gathered block for backward: one buffer each. The last block is
    # gathered in place (and so is the final norm): copied out, its rank-major gather buffer
    # would sit idle from the end of the forward to the end of the step, a block more than
    # the step needs at its peak.
    zero2 = deep_runs["zero2"]
    assert zero2.pool_buffers[block_numel] == n_blocks
    assert zero2.per_tensor_gathers == (f"blocks.{n_blocks - 1}", "norm_f")
    assert not deep_runs["zero3"].per_tensor_gathers
    assert not zero2.reduces_from_copy  # each lay-out reuses the buffer its block's backward left
    # ZeRO3 needs two block buffers, as on NCCL: the block in use and the next arriving. The
    # lay-outs that, all-reduced in place until their waits, would be a third go to gloo's copy
    # of a reduce-scatter's input at the launch: all but the first block's, which reduces in
    # the pool once no gather needs a buffer.
    assert deep_runs["zero3"].pool_buffers[block_numel] == 2
    assert set(deep_runs["zero3"].reduces_from_copy) == {f"blocks.{k}" for k in range(1, n_blocks)}
    # ZeRO3 frees a block after its last use; buffers are reused as the window moves. Busy at
    # once: the all-gathers ahead and the reduce-scatters not yet waited on (one bucket each by
    # default: a second goes out early only where the cost model says one does not hide it,
    # which gloo on a CPU never asks for here), the block in use and the one being copied out.
    for name, depth in (("zero3", 1), ("zero3, two blocks ahead", 2)):
        assert deep_runs[name].pool_buffers[block_numel] <= 2 * depth + 2, name
    assert deep_runs["zero3"].pool_buffers[block_numel] < deep_runs["zero3, two blocks ahead"].pool_buffers[block_numel]


def test_buckets_as_on_nccl_need_no_copy_out_or_reduce_scatter_buffers(deep_runs):
    # As on NCCL: each parameter is gathered into its place, so no block needs a copy-out buffer;
    # the blocks' gradients need no padding, so their reduce-scatters read them where they are
    # and take no pool buffer; only the odd-sized embedding still lays its gradient out, and
    # the last buckets reduce in place in a buffer no gather needs anymore.
    block_numel = max(deep_runs["zero3"].bucket_numels)
    nccl, gloo = deep_runs["zero3, as on NCCL"], deep_runs["zero3"]
    uses = {use for slot in nccl.pool_users for use in slot}
    assert nccl.reduced_in_pool
    in_place = {f"{label} reduce-scatter in place" for label in nccl.reduced_in_pool}
    laid_out = {"wte reduce-scatter"} - {"wte reduce-scatter" for label in nccl.reduced_in_pool if label == "wte"}
    assert {use for use in uses if " reduce-scatter" in use} == laid_out | in_place
    assert not {use for use in uses if use.endswith("copy-out")}
    # In the forward, the block in use and the one arriving; nothing else is a block buffer.
    assert nccl.pool_buffers[block_numel] == 2
    # Over gloo as many: a copy-out takes the buffer of the block whose compute just ended, and
    # the lay-outs that would take a third go to gloo's copy (test_zero3_pool_holds_only_...).
    assert gloo.pool_buffers[block_numel] == nccl.pool_buffers[block_numel]


def _pool_reuse_after_in_place_all_reduces(rank: int, world_size: int, rounds: int) -> int:
    """Allocations of a pool whose one buffer is all-reduced in place, waited on, settled and
    dropped, ``rounds`` times over: the bucket path of a laid-out reduce-scatter over gloo."""
    import torch.distributed as dist

    from thunder_overlap._bucketing.pool import BufferPool, PendingCollective, all_reduce_in_place

    pool = BufferPool()
    for _ in range(rounds):
        buffer = pool.acquire(1 << 16, torch.float32, torch.device("cpu"), "reduce-scatter")
        pending = PendingCollective(None, buffer, source=buffer)
        pending.mark_launch()
        pending.work = all_reduce_in_place(buffer, dist.group.WORLD)
        pending.work.wait()
        pending.settle()
        del buffer, pending
    return pool.allocations


def test_a_buffer_all_reduced_in_place_is_idle_once_settled(local_ranks):
    # gloo's all-reduce work holds the tensor it is handed until its worker thread lets go,
    # sometimes after wait returns; settle must see that hold, or the pool grows by chance.
    assert local_ranks(_pool_reuse_after_in_place_all_reduces, WORLD_SIZE, (200,)) == [1, 1]


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3, two blocks ahead", "zero3, as on NCCL"])
def test_slot_plan_from_the_final_traces_is_the_pool_the_steps_grew(deep_runs, name):
    # Planned from the live intervals of the final traces alone, the pool must be the
    # one the runtime grew over two steps: the same buffers, each serving the same uses in the
    # same order. A step whose busy buffers exceeded the plan would have grown the pool.
    census = deep_runs[name]
    assert census.planned_pool_buffers == census.pool_buffers
    assert sorted(census.planned_pool_users) == sorted(census.pool_users)


# --- what a user does ---------------------------------------------------------------------------


def _batch(step: int, micro: int, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, MODEL.vocab_size, (2, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(jm, idx, targets) -> torch.Tensor:
    logits = jm(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _user_session(rank: int, world_size: int, bucketing: str) -> dict:
    """Accumulation with both zero_grad modes, a retrace, state dicts; the same on every model."""
    import thunder_overlap
    from thunder_overlap._transforms import BucketingTransform

    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", bucketing_strategy=bucketing)
    optimizer = torch.optim.SGD([p for p in jm.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    result: dict = {"grads": [], "losses": []}
    for step in range(3):
        # Step 0 starts from no gradients; later steps zero them in place, so .grad still aliases
        # the bucket's gradient shard when the next reduce-scatter writes.
        optimizer.zero_grad(set_to_none=step == 0)
        for micro in range(2):
            loss = _loss(jm, *_batch(step, micro))
            loss.backward()
            result["losses"].append(loss.item())
        result["grads"].append({n: p.grad.clone() for n, p in jm.named_parameters() if p.requires_grad})
        optimizer.step()
    bucketing_transform = BucketingTransform.of(jm)
    allocations = bucketing_transform.allocations if bucketing_transform else 0
    if bucketing_transform:  # whose .grad, kept across micro-batches and steps, is a pool row
        result["reduced_in_pool"] = [b.plan.label for b in bucketing_transform.buckets if b.layout.reduce is ReducePath.IN_POOL]
    # A new input shape: Thunder traces again; the buckets and their buffers stay the same.
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(jm, *_batch(3, 0, seq_len=8))
    loss.backward()
    result["retraced_loss"] = loss.item()
    result["retraced_grads"] = {n: p.grad.clone() for n, p in jm.named_parameters() if p.requires_grad}
    if bucketing_transform:
        result["allocations_added_by_retrace"] = bucketing_transform.allocations - allocations
    result["original_state_dict"] = {k: v.clone() for k, v in jm.original_state_dict().items()}
    pointers = [p.data_ptr() for p in jm.parameters()]
    jm.load_state_dict({k: v * 0.5 for k, v in jm.state_dict().items()})
    result["load_kept_parameters"] = pointers == [p.data_ptr() for p in jm.parameters()]
    result["loss_after_load"] = _loss(jm, *_batch(4, 0)).item()
    if bucketing_transform:
        jm.load_state_dict({k: v.clone() for k, v in jm.state_dict().items()}, assign=True)
        try:
            jm(_batch(4, 0)[0])
        except RuntimeError as e:
            result["assign_error"] = str(e)
    return result


@pytest.fixture(scope="module")
def sessions(local_ranks):
    return {b: local_ranks(_user_session, WORLD_SIZE, (b,)) for b in ("none", "block")}


def test_accumulation_zero_grad_modes_and_retrace_match_unbucketed(sessions):
    for bucketed, plain in zip(sessions["block"], sessions["none"], strict=True):
        torch.testing.assert_close(bucketed["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
        for step, (b, p) in enumerate(zip(bucketed["grads"], plain["grads"], strict=True)):
            for name in p:
                torch.testing.assert_close(b[name], p[name], rtol=1e-5, atol=1e-6, msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")
        assert bucketed["retraced_loss"] == pytest.approx(plain["retraced_loss"], rel=1e-5)
        for name in plain["retraced_grads"]:
            torch.testing.assert_close(bucketed["retraced_grads"][name], plain["retraced_grads"][name], rtol=1e-5, atol=1e-6)
        assert bucketed["allocations_added_by_retrace"] == 0
        assert bucketed["reduced_in_pool"]


def test_state_dicts_round_trip_through_the_bucket_buffers(sessions):
    for bucketed, plain in zip(sessions["block"], sessions["none"], strict=True):
        assert bucketed["original_state_dict"].keys() == plain["original_state_dict"].keys()
        for name, value in plain["original_state_dict"].items():
            torch.testing.assert_close(bucketed["original_state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert bucketed["load_kept_parameters"]
        assert bucketed["loss_after_load"] == pytest.approx(plain["loss_after_load"], rel=1e-5)


def _no_sync_session(rank: int, world_size: int) -> dict:
    """Two optimizer steps of three micro-batches, on two identical bucketed ZeRO3 models: one
    synchronises every backward, the other runs the first two micro-batches under no_sync (Thunder's
    ``ThunderModule.no_sync`` and ``skip_data_parallel_grad_sync``), counting the buckets that reduce-scatter."""
    from thunder_overlap._bucketing import reduction
    from thunder_overlap._transforms import BucketingTransform

    # (gradient shard storage, address written) per reduce-scatter launched (every launch, alone
    # or coalesced, goes through reduction.launch): a bucket that sends its gradients where they
    # are writes each into its own slot, the others the whole shard.
    sent = []
    launch = reduction.launch

    def counted(bucket, pending, **kwargs):
        written = [piece for piece, _ in pending.sends] if pending.sends is not None else [pending.result]
        sent.extend((t.untyped_storage().data_ptr(), t.data_ptr()) for t in written)
        return launch(bucket, pending, **kwargs)

    reduction.launch = counted
    try:  # restored: these ranks run other tests' functions afterwards
        result: dict = {"grads": {}, "sent_per_micro_batch": {}, "grads_none_under_no_sync": []}
        for mode in ("sync", "no_sync"):
            jm = _no_sync_steps(rank, mode, sent, result)
    finally:
        reduction.launch = launch
    summaries = BucketingTransform.of(jm).summaries
    result["accumulations"] = summaries.backward_no_sync.accumulations
    result["reduce_scatters_under_no_sync"] = summaries.backward_no_sync.reduce_scatters
    result["reduce_scatters"] = summaries.backward.reduce_scatters
    return result


def _no_sync_steps(rank: int, mode: str, sent: list, result: dict):
    import thunder

    import thunder_overlap

    torch.manual_seed(0)
    jm = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", bucketing_strategy="block")
    optimizer = torch.optim.SGD([p for p in jm.parameters() if p.requires_grad], lr=0.05)
    contexts = [contextlib.nullcontext] * 3
    if mode == "no_sync":
        contexts[:2] = [jm.no_sync, thunder.distributed.skip_data_parallel_grad_sync]
    grads, sent_per_micro_batch = [], []
    for step in range(2):
        optimizer.zero_grad(set_to_none=step == 0)
        for micro, context in enumerate(contexts):
            before = len(sent)
            with context():
                _loss(jm, *_batch(step, micro + 10 * rank)).backward()
            written = sent[before:]
            assert len(set(written)) == len(written), "a gradient shard slot was reduced into twice"
            # Buckets that sent: the gradient shards written.
            sent_per_micro_batch.append(len({storage for storage, _ in written}))
            if mode == "no_sync" and step == 0 and micro < 2:
                result["grads_none_under_no_sync"].append(all(p.grad is None for p in jm.parameters()))
        grads.append({n: p.grad.clone() for n, p in jm.named_parameters() if p.requires_grad})
        optimizer.step()
    result["grads"][mode] = grads
    result["sent_per_micro_batch"][mode] = sent_per_micro_batch
    return jm


def test_no_sync_accumulates_in_the_buckets_and_sends_once(local_ranks):
    for r in local_ranks(_no_sync_session, WORLD_SIZE):
        trainable_buckets = r["reduce_scatters"]
        assert trainable_buckets > 0
        # Under no_sync one local accumulation per bucket replaces each reduce-scatter.
        assert r["accumulations"] == trainable_buckets and r["reduce_scatters_under_no_sync"] == 0
        assert r["sent_per_micro_batch"]["sync"] == [trainable_buckets] * 6
        assert r["sent_per_micro_batch"]["no_sync"] == [0, 0, trainable_buckets] * 2
        # Thunder hands autograd None under no_sync; the sum arrives with the next backward.
        assert r["grads_none_under_no_sync"] == [True, True]
        # The same six gradient shares per step (3 micro-batches on 2 ranks), added in another
        # order: float32 may differ by gamma_6 (3.6e-7) times their absolute sum, which atol 1e-6
        # covers up to a sum of 2.8 (a TinyGPT micro-batch's gradient elements stay below about
        # 0.2, measured 0.11); rtol 1e-5 adds more.
        for step, (got, expected) in enumerate(zip(r["grads"]["no_sync"], r["grads"]["sync"], strict=True)):
            assert got.keys() == expected.keys()
            for name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def test_replacing_a_parameter_is_a_clear_error(sessions):
    for bucketed in sessions["block"]:
        assert "no longer lives in bucket" in bucketed["assign_error"]
        assert "assign=False" in bucketed["assign_error"]
