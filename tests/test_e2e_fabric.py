"""FSDPOverlapStrategy inside Lightning Fabric on 2 gloo ranks (the shared rank session: Fabric
sees the ranks as started by torchrun).

One job per rank builds Fabric objects and returns what each check needs:

- ``fabric.setup(model, optimizer)`` with the optimizer built on the unsharded parameters (of a
  model built on the meta device by ``fabric.init_module(empty_init=True)``, and of one built on
  the CPU and passed through ``thunder.jit``) trains bit for bit as litgpt's order (``setup_module``, then the optimizer, then
  ``setup_optimizers``); every parameter Fabric's wrapper lists is a shard the optimizer holds;
  ``precision="bf16-mixed"`` computes in bf16 and keeps float32 parameters;
  ``activation_checkpointing=True`` recomputes litgpt's blocks and trains as without;
- a full checkpoint (``state_dict_type="full"``) of the model trained in litgpt's order loads into
  a plain litgpt ``GPT`` whose logits are the sharded model's;
- a sharded checkpoint of the one trained from the meta device restores a scheduler and the step,
  and returns what was not asked for;
- ``fabric.clip_gradients(clip_val=...)`` clamps every element; ``all_reduce``, ``broadcast``;
- misuse gets the same clear error on both ranks, and nothing hangs.

Then, on 4 ranks as 2 nodes of 2 devices, ``hybrid_sharding=True``: the model is sharded within
each node and replicated across the two, and a clipped step leaves each node's shards equal.

The example's parity with one device and its resumes: tests/test_e2e_fabric_example.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.ranks

WORLD_SIZE = 2
STEPS = 2
SEQ_LEN = 16


def _tiny_llama():
    from litgpt import Config
    from litgpt.model import GPT

    config = Config(name="tiny-llama", block_size=SEQ_LEN, vocab_size=96, padding_multiple=32, n_layer=1, n_head=4,
                    n_query_groups=2, n_embd=32, intermediate_size=64, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", parallel_residual=False, rotary_percentage=1.0)  # fmt: skip
    return GPT(config)


def _fabric(precision: str = "32-true", **strategy):
    from lightning.fabric import Fabric

    from thunder_overlap.fabric import FSDPOverlapStrategy

    strategy = FSDPOverlapStrategy(block_types="Block", **strategy)
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(7)
    return fabric


def _tokens(fabric, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    batch = torch.randint(96, (2 * fabric.world_size, SEQ_LEN + 1), generator=g)
    return batch[fabric.global_rank * 2 : (fabric.global_rank + 1) * 2]


def _step(fabric, model, optimizer, step: int) -> float:
    batch = _tokens(fabric, step)
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=0.1)
    optimizer.step()
    optimizer.zero_grad()
    return fabric.all_reduce(loss.detach(), reduce_op="mean").item()


@dataclass
class _Trained:
    """What one order's run returns, and the objects the checkpoint and misuse checks go on with
    (compiling dominates this module's time: they reuse trained models instead of compiling more)."""

    result: dict
    fabric: object
    plain: torch.nn.Module
    model: torch.nn.Module
    optimizer: object


def _train(order: str) -> _Trained:
    """Two steps of the tiny Llama, set up in ``order``; the losses and what Fabric's wrapper
    lists. litgpt's order saves full checkpoints (``state_dict_type`` changes only how
    ``fabric.save`` writes)."""
    import thunder

    if order == "bf16-mixed":
        fabric = _fabric(precision="bf16-mixed")
    elif order == "litgpt":
        fabric = _fabric(state_dict_type="full")
    else:
        fabric = _fabric(activation_checkpointing=order == "checkpointed")
    with fabric.init_module(empty_init=order == "setup, meta"):
        model = plain = _tiny_llama()
    if order == "jitted, setup":
        model = thunder.jit(model)
    if order in ("litgpt", "bf16-mixed", "checkpointed"):
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    listed = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    losses = [_step(fabric, model, optimizer, step) for step in range(STEPS)]
    result = {
        "losses": losses,
        "listed_are_held": {id(p) for p in listed} == {id(p) for p in held},
        "sharded_are_held": {id(p) for p in model._forward_module.parameters()} == {id(p) for p in held},
        "meta": sum(p.is_meta for p in listed),
        "dtypes": {p.dtype for p in listed},
        "state": {name: p.detach().clone() for name, p in model._forward_module.named_parameters()},
        # The backward recomputes the blocks: it runs their linears again (otherwise it has none).
        "checkpointed": _backward_linears(model._forward_module) > 0,
    }
    return _Trained(result, fabric, plain, model, optimizer)


def _backward_linears(module) -> int:
    import thunder

    return sum(b.sym.name == "linear" for b in thunder.last_backward_traces(module)[-1].bound_symbols)


def _checkpoints(rank: int, tmp: Path, full_run: _Trained, sharded_run: _Trained) -> dict:
    """Full checkpoints of ``full_run`` (litgpt's order), sharded ones of ``sharded_run``."""
    result: dict = {}
    # Full: one file the plain model loads; its logits are the sharded model's.
    fabric, model, optimizer = full_run.fabric, full_run.model, full_run.optimizer
    path = Path(fabric.broadcast(str(tmp / "full.pth")))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    probe = _tokens(fabric, 5)[:, :-1]
    with torch.no_grad():
        result["sharded_logits"] = model(probe)
    if rank == 0:
        plain = _tiny_llama()
        plain.load_state_dict(torch.load(path, weights_only=True)["model"])
        with torch.no_grad():
            result["plain_logits"] = plain(probe)
    fabric.barrier()

    # Sharded: a scheduler and the step come back; what was not asked for is returned.
    fabric, model, optimizer = sharded_run.fabric, sharded_run.model, sharded_run.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    _step(fabric, model, optimizer, 0)
    scheduler.step()
    sharded = tmp / "sharded"
    fabric.save(sharded, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 1, "tokens": 64})
    saved = {name: p.detach().clone() for name, p in model._forward_module.named_parameters()}
    _step(fabric, model, optimizer, 1)
    scheduler.step()
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    result["remainder"] = fabric.load(sharded, state)
    result["step"], result["last_epoch"] = state["step"], scheduler.last_epoch
    result["restored"] = all(torch.equal(p, saved[name]) for name, p in model._forward_module.named_parameters())
    _step(fabric, model, optimizer, 2)
    fabric.load_raw(sharded, model)  # the model alone
    result["raw_restored"] = all(torch.equal(p, saved[name]) for name, p in model._forward_module.named_parameters())
    result["optimizer_alone"] = _error_of(lambda: fabric.load(sharded, optimizer))
    result["full_into_sharded"] = fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})
    result["missing_key"] = _error_of(lambda: fabric.load(sharded, {"model": model, "epoch": 0}))
    result["two_models"] = _error_of(lambda: fabric.save(tmp / "two", {"a": model, "b": model}))
    result["weights_only"] = _error_of(lambda: fabric.load(sharded, {"model": model}, weights_only=True))
    return result


def _misuse(rank: int, trained: _Trained) -> dict:
    """Misuse of ``trained``'s Fabric objects, and of new ones."""
    errors: dict = {}
    fabric, plain, model, optimizer = trained.fabric, trained.plain, trained.model, trained.optimizer
    errors["setup twice"] = _error_of(lambda: fabric.setup_module(plain))
    stepped = _tiny_llama()
    stepped_optimizer = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    stepped(_tokens(fabric, 0)[:, :-1]).sum().backward()
    stepped_optimizer.step()
    errors["optimizer with state"] = _error_of(lambda: fabric.setup(stepped, stepped_optimizer))
    other = _tiny_llama()
    errors["optimizer of another model"] = _error_of(lambda: fabric.setup(_tiny_llama(), torch.optim.SGD(other.parameters(), lr=0.1)))

    batch = _tokens(fabric, 0)
    with fabric.no_backward_sync(model):
        fabric.backward(model(batch[:, :-1]).float().square().mean())
        errors["clip inside no_backward_sync"] = _error_of(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0))
    fabric.backward(model(batch[:, :-1]).float().square().mean())
    unclipped = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    fabric.clip_gradients(model, optimizer, clip_val=1e-3)
    clipped = [p.grad for p in model.parameters() if p.grad is not None]
    errors["clip_val clamps"] = all(torch.equal(c, u.clamp(-1e-3, 1e-3)) for c, u in zip(clipped, unclipped, strict=True))
    errors["clip_val clipped some"] = any(not torch.equal(c, u) for c, u in zip(clipped, unclipped, strict=True))

    no_buckets = _fabric(bucketing_strategy="none")
    unbucketed = no_buckets.setup_module(_tiny_llama())
    errors["no_backward_sync without buckets"] = _error_of(lambda: no_buckets.no_backward_sync(unbucketed).__enter__())
    errors["sum"] = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
    errors["broadcast"] = fabric.broadcast(f"from rank {rank}", src=1)
    fabric.barrier()
    return errors


def _error_of(call) -> str | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares the messages
        return f"{type(error).__name__}: {error}"
    return None


def _session(rank: int, world_size: int, tmp: str) -> dict:
    """Every check on this rank; Fabric's environment variables (the seed) are put back."""
    assert world_size == WORLD_SIZE
    environ = dict(os.environ)
    try:
        trained = {order: _train(order) for order in ("litgpt", "setup, meta", "jitted, setup", "bf16-mixed", "checkpointed")}
        return {
            "runs": {order: run.result for order, run in trained.items()},
            "checkpoints": _checkpoints(rank, Path(tmp), full_run=trained["litgpt"], sharded_run=trained["setup, meta"]),
            "misuse": _misuse(rank, trained["litgpt"]),
        }
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _hybrid(rank: int, world_size: int) -> dict:
    """One clipped step as 2 nodes of 2 devices: Fabric reads the node from NODE_RANK and the
    device from LOCAL_RANK, as a cluster's launcher sets them."""
    from thunder_overlap.checkpoint._layout import model_sharding

    environ = dict(os.environ)
    os.environ.update(NODE_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    try:
        from lightning.fabric import Fabric

        from thunder_overlap.fabric import FSDPOverlapStrategy

        fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=FSDPOverlapStrategy(block_types="Block", hybrid_sharding=True))
        fabric.launch()
        fabric.seed_everything(7)
        with fabric.init_module(empty_init=True):
            model = _tiny_llama()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        loss = _step(fabric, model, optimizer, 0)
        mesh = model_sharding(model._forward_module).mesh
        return {
            "global_rank": fabric.global_rank,
            "mesh": mesh.mesh.tolist(),
            "loss": loss,
            "shards": {name: p.detach().clone() for name, p in model._forward_module.named_parameters()},
        }
    finally:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def ranks(local_ranks, tmp_path_factory) -> list[dict]:
    return local_ranks(_session, WORLD_SIZE, (str(tmp_path_factory.mktemp("fabric")),), timeout_s=900)


@pytest.mark.parametrize("order", ["setup, meta", "jitted, setup"])
def test_an_optimizer_built_before_setup_or_a_jitted_model_trains_as_litgpts_order(ranks, order):
    for result in ranks:
        run, reference = result["runs"][order], result["runs"]["litgpt"]
        assert run["meta"] == 0 and run["listed_are_held"] and run["sharded_are_held"]
        assert run["losses"] == reference["losses"]
        for name, value in reference["state"].items():
            assert torch.equal(run["state"][name], value), name
    assert ranks[0]["runs"][order]["losses"] == ranks[1]["runs"][order]["losses"]


def test_activation_checkpointing_trains_as_without(ranks):
    # The recomputation runs the forward's ops again on the same inputs; the backward may order
    # its sums otherwise, so float32's rounding (assert_close's float32 defaults) is allowed.
    for result in ranks:
        run, reference = result["runs"]["checkpointed"], result["runs"]["litgpt"]
        assert run["checkpointed"] and not reference["checkpointed"]
        torch.testing.assert_close(run["losses"], reference["losses"])
        for name, value in reference["state"].items():
            torch.testing.assert_close(run["state"][name], value, msg=name)


def test_the_full_checkpoint_loads_into_the_plain_model(ranks):
    logits = ranks[0]["checkpoints"]
    # The same float32 weights and tokens; Thunder's program and eager PyTorch may order a
    # reduction differently, by a few ulps of the logits (|logits| < 10 here: 1e-5 is ~10 ulps).
    torch.testing.assert_close(logits["plain_logits"], logits["sharded_logits"], rtol=0, atol=1e-5)


def test_a_sharded_checkpoint_restores_the_scheduler_and_the_step(ranks):
    for result in ranks:
        checks = result["checkpoints"]
        assert checks["restored"] and checks["raw_restored"] and checks["step"] == 1 and checks["last_epoch"] == 1
        assert checks["remainder"] == {"tokens": 64}
        assert checks["full_into_sharded"] == {}


@pytest.mark.parametrize(
    ("part", "case", "message"),
    [
        ("checkpoints", "missing_key", r"has no 'epoch' \(it has \['model', 'optimizer', 'scheduler', 'step', 'tokens'\]\); pass strict"),
        ("checkpoints", "two_models", r"ValueError: fabric.save with FSDPOverlapStrategy takes one model in the state, got 2 \('a', 'b'\)"),
        ("checkpoints", "weights_only", r"ValueError: fabric.load\(..., weights_only=True\) cannot be honoured"),
        ("checkpoints", "optimizer_alone", r"ValueError: fabric.load with FSDPOverlapStrategy loads an optimizer with its model"),
        ("misuse", "setup twice", r"ValueError: .* is already sharded with FSDP: an earlier thunder_overlap.fsdp consumed it"),
        ("misuse", "optimizer with state", r"ValueError: optimizer 0 \(SGD\) already has state for \d+ parameters"),
        ("misuse", "optimizer of another model", r"ValueError: optimizer 0 \(SGD\) holds a parameter of shape .* not one of the model's"),
        ("misuse", "clip inside no_backward_sync", r"RuntimeError: thunder_overlap.clip_grad_norm_ was called inside no_sync\(\)"),
        ("misuse", "no_backward_sync without buckets", r"ValueError: fabric.no_backward_sync needs bucketing_strategy 'layer', 'block'"),
    ],
)
def test_misuse_is_named_on_every_rank(ranks, part, case, message):
    errors = [result[part][case] for result in ranks]
    assert errors[0] == errors[1]
    assert errors[0] is not None and re.search(message, errors[0]), errors[0]


def test_clip_val_and_collectives(ranks):
    for result in ranks:
        misuse = result["misuse"]
        assert misuse["clip_val clamps"] and misuse["clip_val clipped some"]
        assert misuse["sum"] == 3.0 and misuse["broadcast"] == "from rank 1"


def test_hybrid_sharding_shards_within_a_node_and_replicates_across_nodes(local_ranks):
    results = local_ranks(_hybrid, 4, (), timeout_s=600)
    assert [r["global_rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["mesh"] == [[0, 1], [2, 3]] for r in results)  # (replicate: the nodes) x (shard: a node's devices)
    assert len({r["loss"] for r in results}) == 1
    for rank in (0, 1):  # the same shard on both nodes, bit for bit: the replicas' all-reduce gave both the same
        node_0, node_1 = results[rank]["shards"], results[rank + 2]["shards"]
        assert node_0.keys() == node_1.keys() and all(torch.equal(node_0[n], node_1[n]) for n in node_0)
    assert not torch.equal(results[0]["shards"]["lm_head.weight"], results[1]["shards"]["lm_head.weight"])


def test_bf16_mixed_computes_in_bf16_over_float32_masters(ranks):
    for result in ranks:
        run, reference = result["runs"]["bf16-mixed"], result["runs"]["litgpt"]
        assert run["dtypes"] == {torch.float32} and run["listed_are_held"]
        # bf16 compute: the loss moves by bf16's rounding (8 bits of mantissa: ~4e-3 relative per
        # rounding, a few of which add up over the layers), never by float32's.
        for loss, expected in zip(run["losses"], reference["losses"], strict=True):
            assert loss != expected and abs(loss - expected) < 5e-2 * abs(expected), (loss, expected)
