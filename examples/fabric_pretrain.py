"""Pretrain a litgpt model with Lightning Fabric and thunder_overlap's FSDP, in the shape of litgpt's
pretraining loop: meta-device init, AdamW with warmup and cosine decay, gradient accumulation under
``no_backward_sync``, clipping, periodic checkpoints and ``--resume``.

    python examples/fabric_pretrain.py --accelerator cpu --devices 2 --max-steps 4
    torchrun --nproc_per_node 8 examples/fabric_pretrain.py --devices 8 --precision bf16-mixed \\
        --model Llama-2-7b-hf --n-layer 4 --seq-len 4096 --global-batch 16 --micro-batch 1 --save-every 100

Fabric starts the other processes itself from a plain ``python`` run, or takes torchrun's. Coming
from litgpt's Thunder strategy, the one change is the strategy:
``FSDPOverlapStrategy(sharding_strategy="zero3", bucketing_strategy="block")``.

Needs ``pip install 'thunder_overlap[examples]'`` (litgpt, Lightning). The data are synthetic and
deterministic: step ``s`` is the same global batch of token sequences whatever the number of
devices, so runs on 1 and 2 devices print the same losses.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from thunder_overlap.fabric import FSDPOverlapStrategy

VOCAB_SIZE = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--devices", type=int, default=1, help="processes per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", choices=("32-true", "bf16-true", "bf16-mixed"), default="32-true")
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (default: one Llama block) or a litgpt config name")
    p.add_argument("--n-layer", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--sharding", choices=("zero2", "zero3", "auto"), default="zero3")
    p.add_argument("--bucketing", choices=("none", "layer", "block", "auto"), default="block")
    p.add_argument("--state-dict-type", choices=("sharded", "full"), default="sharded")
    p.add_argument("--max-steps", type=int, default=10, help="optimizer steps to train until (a resumed run counts the earlier ones)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step over all devices")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward; the rest are accumulated")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the gradient to this global norm")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", type=Path, default=Path("out/fabric_pretrain"))
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every this many steps (0: never)")
    p.add_argument("--resume", type=Path, default=None, help="a checkpoint this script saved (any number of devices)")
    args = p.parse_args()
    for flag in ("devices", "num_nodes", "max_steps", "global_batch", "micro_batch", "seq_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} is not allowed; it must be at least 1")
    ranks = args.devices * args.num_nodes
    if args.global_batch % (ranks * args.micro_batch):
        p.error(f"--global-batch {args.global_batch} must be a multiple of --devices x --num-nodes x --micro-batch "
                f"= {ranks * args.micro_batch}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        p.error(f"--out-dir {args.out_dir} is a file; checkpoints go in a directory")
    if args.resume is not None and not args.resume.exists():
        p.error(f"--resume {args.resume} does not exist")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from litgpt import Config
    from litgpt.model import GPT

    # Llama-style (RMSNorm, RoPE, grouped queries, SwiGLU MLP), tiny: a few seconds to compile on a CPU,
    # most of them per block.
    if args.model == "tiny-llama":
        config = Config(name="tiny-llama", block_size=args.seq_len, vocab_size=VOCAB_SIZE, padding_multiple=64,
                        n_layer=args.n_layer or 1, n_head=4, n_query_groups=2, n_embd=64, intermediate_size=172, bias=False,
                        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False, rotary_percentage=1.0)
    else:
        config = Config.from_name(args.model, block_size=args.seq_len, **({"n_layer": args.n_layer} if args.n_layer else {}))
    return GPT(config)


def global_batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    """Step ``step``'s sequences: each follows x -> (5x + 3) mod vocab from a random start."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = [torch.randint(VOCAB_SIZE, (args.global_batch,), generator=g)]
    for _ in range(args.seq_len):
        tokens.append((5 * tokens[-1] + 3) % VOCAB_SIZE)
    return torch.stack(tokens, dim=1)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at ``max_steps``, as litgpt's pretraining."""
    if step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def main() -> None:
    args = parse_args()
    strategy = FSDPOverlapStrategy(sharding_strategy=args.sharding, bucketing_strategy=args.bucketing,
                                   block_types="Block", state_dict_type=args.state_dict_type)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                    strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(args.seed)  # every rank initialises the same weights

    with fabric.init_module(empty_init=True):  # meta: setup_module allocates only this rank's shards
        model = build_model(args)
    model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} after step {state['step']}")
        if state["step"] >= args.max_steps:
            fabric.print(f"nothing to do: the checkpoint is at step {state['step']}, --max-steps is {args.max_steps}")

    first_step = state["step"] + 1
    rows = args.global_batch // fabric.world_size
    accumulate = rows // args.micro_batch
    tokens_per_step = args.global_batch * args.seq_len
    while state["step"] < args.max_steps:
        step = state["step"] + 1
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = global_batch(step, args)[fabric.global_rank * rows : (fabric.global_rank + 1) * rows].to(fabric.device)
        loss_sum = torch.zeros((), device=fabric.device)
        for micro in range(accumulate):
            chunk = batch[micro * args.micro_batch : (micro + 1) * args.micro_batch]
            # Gradients are summed on each rank until the last micro-batch's backward reduces them.
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                logits = model(chunk[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1)) / accumulate
                fabric.backward(loss)
            loss_sum += loss.detach()
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)  # the whole model's norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] = step
        mean_loss = fabric.all_reduce(loss_sum, reduce_op="mean").item()
        seconds = time.perf_counter() - start
        compiled = "  (includes compilation)" if step == first_step else ""
        fabric.print(f"step {step}/{args.max_steps}  loss {mean_loss:.6f}  grad norm {grad_norm.item():.6f}  "
                     f"lr {learning_rate(step, args):.2e}  {tokens_per_step / seconds:,.0f} tokens/s{compiled}")
        if args.save_every and step % args.save_every == 0:
            path = args.out_dir / (f"step-{step:06d}" + (".pth" if args.state_dict_type == "full" else ""))
            fabric.save(path, state)
            fabric.print(f"saved {path}")


if __name__ == "__main__":
    main()
