"""Train a language model with thunder_overlap's FSDP: a complete script to copy and adapt.

    torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 2 --device cpu
    torchrun --nproc_per_node 8 examples/train_fsdp.py --device cuda --model Llama-2-7b-hf --n-layer 4 \\
        --sharding zero3 --bucketing block --global-batch 8 --seq-len 4096 --save-dir ckpt
    torchrun --nproc_per_node 8 examples/train_fsdp.py --device cuda ... --steps 20 --resume ckpt

Needs ``pip install -e '.[examples]'`` (litgpt; transformers 4.47.1 for ``--model hf-llama-tiny``,
which traces under Thunder 0.2.6 as 4.46.3 did; 4.57 does not). The data are synthetic and
deterministic: step ``s`` draws the same global batch of token sequences on every rank and
whatever the world size, and each rank trains on its own rows, so runs at different world sizes
see the same tokens and print the same losses.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import thunder_overlap
from thunder_overlap import checkpoint


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (default), a litgpt config name, or hf-llama-tiny")
    p.add_argument("--n-layer", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: gloo; cuda: NCCL, one GPU per process (default: cuda when visible)")
    p.add_argument("--sharding", choices=("zero2", "zero3"), default="zero3")
    p.add_argument("--bucketing", choices=("none", "layer", "block", "auto"), default="block")
    p.add_argument("--steps", type=int, default=10, help="train until this step (counting the steps of a resumed run)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks (divisible by the world size)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0,
                   help="clip the gradient to this global norm each step, as litgpt does (inf: only report the norm)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-dir", type=Path, default=None, help="save a checkpoint there after the last step")
    p.add_argument("--resume", type=Path, default=None, help="load this checkpoint (any world size) and continue")
    args = p.parse_args()
    for flag, value in (("--steps", args.steps), ("--global-batch", args.global_batch), ("--seq-len", args.seq_len)):
        if value < 1:
            p.error(f"{flag} {value} is not allowed; it must be at least 1")
    if not args.max_norm > 0:
        p.error(f"--max-norm {args.max_norm} is not allowed; it must be positive (inf reports the norm without clipping)")
    # Checked before training: save would refuse these only after the last step.
    if args.save_dir is not None and args.save_dir.is_file():
        p.error(f"--save-dir {args.save_dir} is a file; a checkpoint is a directory")
    holds_other_files = args.save_dir is not None and args.save_dir.is_dir() and any(args.save_dir.iterdir())
    if holds_other_files and not (args.save_dir / ".metadata").is_file():
        p.error(f"--save-dir {args.save_dir} is a directory that holds something other than a checkpoint; choose another")
    if args.resume is not None and not args.resume.exists():
        p.error(f"--resume {args.resume} does not exist")
    # torchrun sets WORLD_SIZE and RANK: checked before the ranks meet, and said once, by rank 0.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % world:
        if int(os.environ.get("RANK", "0")) == 0:
            lower, upper = args.global_batch // world * world, -(-args.global_batch // world) * world
            print(f"error: --global-batch {args.global_batch} does not split over {world} ranks: pass a multiple of {world}, "
                  f"such as --global-batch {upper}" + (f" or {lower}" if lower else ""), file=sys.stderr)
        sys.exit(2)
    return args


def build_model(args: argparse.Namespace, vocab_size: int):
    """The model, on the meta device where it can be (fsdp() then allocates and initialises only
    this rank's shards), and how to get logits from it."""
    if args.model == "hf-llama-tiny":
        from transformers import LlamaConfig, LlamaForCausalLM  # transformers 4.46.3 or 4.47.1 (4.57 does not trace)

        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=172, num_hidden_layers=args.n_layer or 2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
        # Built on the CPU: Thunder cannot initialise it from meta (LlamaRotaryEmbedding has no reset_parameters).
        return LlamaForCausalLM(config), lambda m, idx: m(input_ids=idx, use_cache=False).logits
    from litgpt import Config
    from litgpt.model import GPT

    if args.model == "tiny-llama":  # Llama-style (RMSNorm, RoPE, grouped queries, SwiGLU MLP), tiny: seconds on a CPU
        config = Config(name="tiny-llama", block_size=args.seq_len, vocab_size=vocab_size, padding_multiple=64,
                        n_layer=args.n_layer or 2, n_head=4, n_query_groups=2, n_embd=64, intermediate_size=172, bias=False,
                        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False, rotary_percentage=1.0)
    else:
        config = Config.from_name(args.model, **({"n_layer": args.n_layer} if args.n_layer else {}))
    with torch.device("meta"):
        model = GPT(config)
    return model, lambda m, idx: m(idx)


def global_batch(step: int, args: argparse.Namespace, vocab_size: int) -> torch.Tensor:
    """Step ``step``'s sequences, the same on every rank: each follows x -> (5x + 3) mod vocab from a
    random start, a pattern the model can learn."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = [torch.randint(vocab_size, (args.global_batch,), generator=g)]
    for _ in range(args.seq_len):
        tokens.append((5 * tokens[-1] + 3) % vocab_size)
    return torch.stack(tokens, dim=1)


def main() -> None:
    args = parse_args()
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = args.global_batch // world

    vocab_size = 256
    torch.manual_seed(args.seed)  # every rank initialises the same weights
    model, logits_of = build_model(args, vocab_size)
    model = thunder_overlap.fsdp(model.to(dtype), device=device, sharding_strategy=args.sharding, bucketing_strategy=args.bucketing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    step = 0
    if args.resume is not None:
        step = checkpoint.load(args.resume, model, optimizer).extra_state["step"]
        if rank == 0:
            print(f"resumed from {args.resume} after step {step}", flush=True)
            if step >= args.steps:
                print(f"nothing to train: the checkpoint is after step {step} and --steps is {args.steps}; pass a larger --steps",
                      flush=True)

    tokens_per_step = args.global_batch * args.seq_len
    first_step = step + 1
    while step < args.steps:
        step += 1
        start = time.perf_counter()
        batch = global_batch(step, args, vocab_size)[rank * local : (rank + 1) * local].to(device)
        idx, targets = batch[:, :-1], batch[:, 1:]
        logits = logits_of(model, idx)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()  # gradients are averaged over the ranks: the global batch's mean
        # The whole model's norm, the same on every rank (torch.nn.utils.clip_grad_norm_ on the
        # shards would take each rank's own).
        grad_norm = model.clip_grad_norm_(args.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the global batch's loss (gloo has no AVG: sum, then divide)
        mean_loss = mean_loss.item() / world  # .item() waits for the step to finish on the GPU
        seconds = time.perf_counter() - start
        if rank == 0:
            compiled = "  (includes compilation)" if step == first_step else ""
            print(f"step {step}/{args.steps}  loss {mean_loss:.6f}  grad norm {grad_norm.item():.6f}  "
                  f"{tokens_per_step / seconds:,.0f} tokens/s{compiled}", flush=True)

    if args.save_dir is not None:
        # Every rank writes its shards; the step is saved inside the checkpoint.
        path = checkpoint.save(args.save_dir, model, optimizer, extra_state={"step": step})
        if rank == 0:
            print(f"saved {path} after step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
