"""The module given to ``fsdp()`` after sharding, on 2 gloo ranks: its parameters are the sharded
module's (the same objects, whose data are this rank's shards, bucket views included), so an
optimizer built before ``fsdp()`` trains exactly like one built after, ``.to("cpu")`` and
``.cpu()`` change nothing, and its ``state_dict()`` holds real tensors, also for a model built on
the meta device."""

from __future__ import annotations

import pytest
import torch

from thunder_overlap.report._builtin_models import TinyGPT, TinyGPTConfig
from thunder_overlap.testing.parity import real_rows
from thunder_overlap.testing.training import TrainSetup, global_batch

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
MODEL = TinyGPTConfig(n_layer=2)
SETUP = TrainSetup(model=MODEL, micro_batch=2, seq_len=16)
STEPS = 3


def _train(model, optimizer, rank: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        idx, targets = global_batch(SETUP, WORLD_SIZE, step)
        rows = slice(rank * SETUP.micro_batch, (rank + 1) * SETUP.micro_batch)
        logits = model(idx[rows])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[rows].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in parameters if p.requires_grad], lr=1e-2)


def _session(rank: int, world_size: int, bucketing: str) -> dict:
    import thunder_overlap

    result: dict = {}
    torch.manual_seed(0)
    before = TinyGPT(MODEL)
    early = _optimizer(before.parameters())  # built on the whole parameters
    sharded = thunder_overlap.fsdp(before, device="cpu", sharding_strategy="zero3", bucketing_strategy=bucketing)
    result["same_objects"] = [id(p) for p in before.parameters()] == [id(p) for p in sharded.parameters()]
    result["shard_shapes"] = {n: tuple(p.shape) for n, p in before.named_parameters()}
    pointers = [p.data_ptr() for p in sharded.parameters()]
    sharded.to("cpu")
    sharded.cpu()
    before.to("cpu")
    result["to_cpu_kept_storage"] = pointers == [p.data_ptr() for p in sharded.parameters()]
    result["initial_shards"] = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    result["early_losses"] = _train(sharded, early, rank)
    result["early_shards"] = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    result["original_state_dict"] = {k: v.clone() for k, v in before.state_dict().items()}

    torch.manual_seed(0)
    after = thunder_overlap.fsdp(TinyGPT(MODEL), device="cpu", sharding_strategy="zero3", bucketing_strategy=bucketing)
    result["late_losses"] = _train(after, _optimizer(after.parameters()), rank)
    result["late_shards"] = {n: p.detach().clone() for n, p in after.named_parameters()}

    torch.manual_seed(0)
    with torch.device("meta"):
        on_meta = TinyGPT(MODEL)
    materialised = thunder_overlap.fsdp(on_meta, device="cpu", bucketing_strategy=bucketing)
    result["meta_same_objects"] = [id(p) for p in on_meta.parameters()] == [id(p) for p in materialised.parameters()]
    result["meta_devices"] = {str(t.device) for t in (*on_meta.parameters(), *on_meta.buffers())}
    on_meta.cpu()
    return result


@pytest.fixture(scope="module", params=["none", "block"])
def runs(request, local_ranks):
    return local_ranks(_session, WORLD_SIZE, (request.param,), timeout_s=600)


def test_the_original_modules_parameters_are_the_shards(runs):
    torch.manual_seed(0)
    full = dict(TinyGPT(MODEL).named_parameters())
    for run in runs:
        assert run["same_objects"] and run["meta_same_objects"]
        # Each a dim-0 shard of ceil(rows / 2) rows (vocabulary 101: padded).
        assert run["shard_shapes"] == {n: (-(-p.shape[0] // WORLD_SIZE), *p.shape[1:]) for n, p in full.items()}
        assert run["meta_devices"] == {"cpu"}


def test_to_cpu_is_a_no_op(runs):
    assert all(run["to_cpu_kept_storage"] for run in runs)


def test_an_optimizer_built_before_fsdp_trains_as_one_built_after(runs):
    torch.manual_seed(0)
    full = dict(TinyGPT(MODEL).named_parameters())
    for rank, run in enumerate(runs):
        # The same parameters, gradients and optimizer arithmetic: bit for bit, on the real rows
        # (a padding row is no parameter: Thunder leaves it uninitialised).
        assert run["early_losses"] == run["late_losses"]

        def real(shard: torch.Tensor, name: str, rank: int = rank) -> torch.Tensor:
            return shard[: real_rows(full[name].shape[0], rank, WORLD_SIZE)[1]]

        # It trained: every trainable parameter moved, the frozen one did not.
        moved = {n for n, p in run["early_shards"].items() if not torch.equal(real(p, n), real(run["initial_shards"][n], n))}
        assert moved == set(run["early_shards"]) - {"wpe.weight"}
        for name, shard in run["late_shards"].items():
            assert torch.equal(real(run["early_shards"][name], name), real(shard, name)), name
            assert torch.equal(real(run["original_state_dict"][name], name), real(shard, name)), name
