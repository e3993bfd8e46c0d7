"""Train the demo model (trunk + MTP) on token files: `python -m training.train --data DIR --out DIR`.

Contract: DIR/train.bin and DIR/valid.bin are uint16 token ids. Loss = LM cross-entropy (x[t+1])
+ mtp_weight * MTP cross-entropy (x[t+2]) + router_aux_loss_coef * the Switch load-balancing loss,
averaged over the trunk's and the MTP's MoE layers. Every run writes OUT/log.jsonl (one JSON object a
line, also printed) and OUT/ckpt.pt (atomically; model, MTP, optimizer, schedule, sampler and RNG
states, step); `--resume` continues from it, and seeing the same batches it ends where an uninterrupted
run ends. The last step exports OUT/model: `save_pretrained` (bf16) with the `mtp.*` tensors merged in,
plus the data folder's tokenizer files.

Determinism: on CPU a run is a function of its arguments (bitwise, for a fixed thread count), and so
is a stopped-and-resumed one. On CUDA it is reproducible within noise only: embedding backward and
the experts' index_add_/grouped GEMMs accumulate with atomics, whose order varies from run to run.
On CUDA the expert GEMMs run in bf16 (`use_bf16_experts`), the rest under bf16 autocast, with fp32
master weights. A long run fits short device sessions: `--time-limit S` checkpoints and stops, and
the same command with `--resume` continues (keep --steps fixed: it shapes the LR schedule).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from training.model import SHIPPED, TINY, build, joint_forward, model_config, save_with_mtp, use_bf16_experts

SIZES = {"demo": SHIPPED, "tiny": TINY}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# arguments a resumed run must share with the run it continues (the rest: logging, device, stopping)
RUN_KEYS = ("steps", "batch", "seq", "lr", "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "seed",
            "mtp_weight", "size", "vocab")


@dataclass(frozen=True)
class TrainArgs:
    data: str
    out: str
    steps: int = 2000
    batch: int = 32
    seq: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    mtp_weight: float = 0.3
    size: str = "demo"
    vocab: int = 4096
    device: str = "cpu"
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    ckpt_every: int = 200
    resume: bool = False
    stop_at: int = 0  # stop (checkpointed) after this step; 0: run to --steps
    time_limit: float = 0.0  # seconds; stop (checkpointed) once passed; 0: none


class TokenFile:
    """A uint16 token file, read in windows of seq + 1 tokens (inputs and their two next tokens)."""

    def __init__(self, path: str, seq: int, vocab: int):
        if not os.path.isfile(path):
            raise SystemExit(f"error: no token file {path}")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq
        if len(self.tokens) < seq + 2:
            raise SystemExit(f"error: {path} holds {len(self.tokens)} tokens, fewer than --seq + 2")
        if (top := int(self.tokens.max())) >= vocab:
            raise SystemExit(f"error: {path} holds token id {top}, outside --vocab {vocab}")

    def random_starts(self, gen: torch.Generator, batch: int) -> list[int]:
        return torch.randint(0, len(self.tokens) - self.seq, (batch,), generator=gen).tolist()

    def even_starts(self, n: int) -> list[int]:
        return np.linspace(0, len(self.tokens) - self.seq - 1, n).astype(np.int64).tolist()

    def windows(self, starts: list[int]) -> torch.Tensor:
        """[len(starts), seq + 1] int64."""
        return torch.from_numpy(np.stack([self.tokens[s:s + self.seq + 1] for s in starts]).astype(np.int64))


def lr_factor(args: TrainArgs, step: int) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def losses(trunk, mtp, tokens: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(LM loss, MTP loss, load-balancing loss) of a [B, T+1] token batch."""
    cfg = trunk.config
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits, mtp_logits, routers = joint_forward(trunk, mtp, tokens)
    lm = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    nxt = F.cross_entropy(mtp_logits.float().flatten(0, 1), tokens[:, 2:].flatten())
    # per layer, then averaged: transformers' helper would pool all layers' counts into one balance
    aux = sum(load_balancing_loss_func((r.float(),), cfg.num_experts, cfg.num_experts_per_tok) for r in routers)
    return lm, nxt, aux / len(routers)


@torch.no_grad()
def evaluate(trunk, mtp, data: TokenFile, args: TrainArgs, device: torch.device) -> tuple[float, float]:
    trunk.eval(), mtp.eval()
    starts = data.even_starts(args.eval_batches * args.batch)
    total = torch.zeros(2, device=device)
    for i in range(0, len(starts), args.batch):
        lm, nxt, _ = losses(trunk, mtp, data.windows(starts[i:i + args.batch]).to(device), device.type == "cuda")
        total += torch.stack([lm, nxt])
    trunk.train(), mtp.train()
    return tuple((total / args.eval_batches).tolist())


def save_checkpoint(path: str, step: int, args: TrainArgs, trunk, mtp, opt, sched, gen) -> None:
    state = {"step": step, "args": asdict(args), "config": trunk.config.to_dict(), "trunk": trunk.state_dict(),
             "mtp": mtp.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "sampler": gen.get_state(), "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path: str, args: TrainArgs, trunk, mtp, opt, sched, gen) -> int:
    if not os.path.isfile(path):
        raise SystemExit(f"error: --resume, but {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if changed := [k for k in RUN_KEYS if state["args"][k] != getattr(args, k)]:
        k = changed[0]
        flag = "--" + k.replace("_", "-")
        raise SystemExit(f"error: {path} was made with {flag} {state['args'][k]}, not {getattr(args, k)}")
    trunk.load_state_dict(state["trunk"])
    mtp.load_state_dict(state["mtp"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    gen.set_state(state["sampler"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"]


def export(out: str, data: str, trunk, mtp) -> str:
    final, tmp = os.path.join(out, "model"), os.path.join(out, "model.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_with_mtp(trunk, mtp, tmp)
    for name in TOKENIZER_FILES:
        if os.path.isfile(src := os.path.join(data, name)):
            shutil.copyfile(src, os.path.join(tmp, name))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def train(args: TrainArgs) -> dict:
    """Run (or resume) training; returns the last log record."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    train_data = TokenFile(os.path.join(args.data, "train.bin"), args.seq, args.vocab)
    valid_data = TokenFile(os.path.join(args.data, "valid.bin"), args.seq, args.vocab)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "ckpt.pt")
    if os.path.isfile(ckpt) and not args.resume:
        raise SystemExit(f"error: {ckpt} exists; pass --resume or choose another --out")
    trunk, mtp = build(model_config(args.vocab, **SIZES[args.size]), seed=args.seed)
    trunk.to(device).train(), mtp.to(device).train()
    if cuda:
        use_bf16_experts(trunk)
    params = [p for m in (trunk, mtp) for p in m.parameters()]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # norms: no decay
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args, s))
    gen = torch.Generator().manual_seed(args.seed)  # the batch sampler: its state is checkpointed
    step = load_checkpoint(ckpt, args, trunk, mtp, opt, sched, gen) if args.resume else 0
    aux_coef = trunk.config.router_aux_loss_coef
    log = open(os.path.join(args.out, "log.jsonl"), "a")
    record: dict = {}

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    emit({"event": "resume" if step else "start", "step": step, "args": asdict(args),
          "params": sum(p.numel() for p in params), "device": torch.cuda.get_device_name(device) if cuda else "cpu"})
    began = last_time = time.perf_counter()
    acc, acc_steps, last_step = torch.zeros(3, device=device), 0, step
    while step < args.steps:
        tokens = train_data.windows(train_data.random_starts(gen, args.batch)).to(device, non_blocking=True)
        lm, nxt, aux = losses(trunk, mtp, tokens, cuda)
        loss = lm + args.mtp_weight * nxt + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        sched.step()
        step += 1
        acc += torch.stack([lm, nxt, aux]).detach()
        acc_steps += 1
        stopping = (args.stop_at and step >= args.stop_at) or \
                   (args.time_limit and time.perf_counter() - began > args.time_limit)
        if step % args.log_every == 0 or step == args.steps or stopping:
            means = (acc / acc_steps).tolist()  # a sync: the time below is the GPU's
            now = time.perf_counter()
            record = {"step": step, "loss": means[0], "mtp_loss": means[1], "aux_loss": means[2],
                      "grad_norm": float(grad_norm), "lr": sched.get_last_lr()[0],
                      "tokens_per_s": (step - last_step) * args.batch * args.seq / (now - last_time)}
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                record["valid_loss"], record["valid_mtp_loss"] = evaluate(trunk, mtp, valid_data, args, device)
            emit(record)
            acc, acc_steps, last_step, last_time = torch.zeros(3, device=device), 0, step, time.perf_counter()
        if step % args.ckpt_every == 0 or step == args.steps or stopping:
            save_checkpoint(ckpt, step, args, trunk, mtp, opt, sched, gen)
        if stopping:
            emit({"event": "stopped", "step": step})
            break
    if step >= args.steps:
        emit({"event": "exported", "step": step, "path": export(args.out, args.data, trunk, mtp)})
    log.close()
    return record


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n")[0])
    for f in fields(TrainArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action="store_true")
        elif f.name in ("data", "out"):
            p.add_argument(flag, required=True)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            p.add_argument(flag, type=kind, default=f.default, choices=sorted(SIZES) if f.name == "size" else None)
    return TrainArgs(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but no CUDA device is available")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    train(args)


if __name__ == "__main__":
    main()
