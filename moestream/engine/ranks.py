"""Several GPUs of one host (`LLM(..., gpus=N)`, `--gpus N`): rank 0 is the caller's process and runs the model;
ranks 1..N-1 are processes started here, each holding its share of the experts (experts/sharding.py) on GPU `rank`
with the pool and host-tier budgets of one GPU, and computing its entries of every MoE layer rank 0 broadcasts.
On the CPU (tests) the ranks are processes on gloo; on GPUs the data goes over NCCL and control over gloo.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from moestream.config import EngineConfig
from moestream.errors import MoestreamError
from moestream.experts.provider import ExpertProvider, ExpertStep, Padding
from moestream.experts.sharding import CALL, HEADER, STOP, Shard, ShardedProvider, header, join
from moestream.experts.store import open_store
from moestream.kernels import ops

# NVLink multicast stays off, in every process: a program using it can take a shared host's GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT = datetime.timedelta(seconds=120)


class Ranks:
    """The other ranks' processes and the process groups, from start to `close`."""

    def __init__(self, store: str, cfg: EngineConfig, device: torch.device, hidden_size: int, top_k: int,
                 dtype: torch.dtype):
        world = cfg.gpus
        if dist.is_initialized():
            raise MoestreamError("another engine with --gpus > 1 runs in this process: close it first")
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise MoestreamError(f"--gpus {world}: this machine has {torch.cuda.device_count()} CUDA devices")
        os.environ.update(NO_MULTICAST)
        address = f"tcp://127.0.0.1:{_free_port()}"
        # fresh interpreters (not multiprocessing's spawn, which would run the caller's main module again)
        self.processes = []
        for rank in range(1, world):
            p = subprocess.Popen([sys.executable, "-m", "moestream.engine.ranks"], stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps((str(store), cfg, device.type, rank, world, address, hidden_size, top_k,
                                        dtype)))
            p.stdin.close()
            self.processes.append(p)
        self.control = _init(device.type, 0, world, address)
        self.shard = Shard(0, world)

    def provider(self, *args, **kw) -> ShardedProvider:
        return ShardedProvider(*args, shard=self.shard, control=self.control, **kw)

    def close(self) -> None:
        """Stop the other ranks' loops and let go of the groups."""
        try:
            header(self.control, STOP)
        finally:
            dist.destroy_process_group()
            for p in self.processes:
                try:
                    p.wait(timeout=TIMEOUT.total_seconds())
                except subprocess.TimeoutExpired:  # stuck in a collective a failed rank left open
                    p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(device_type: str, rank: int, world: int, address: str):
    """The default group (NCCL on GPUs, gloo on the CPU) and the control group (gloo)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=TIMEOUT)
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else dist.group.WORLD


def _rank_main(store: str, cfg: EngineConfig, device_type: str, rank: int, world: int, address: str,
               hidden_size: int, top_k: int, dtype: torch.dtype) -> None:
    control = _init(device_type, rank, world, address)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    provider = ExpertProvider(open_store(store), cfg.expert, device, top_k, shard=Shard(rank, world))
    try:
        with torch.inference_mode():
            serve(provider, control, device, hidden_size, top_k, dtype)
    finally:
        provider.close()
        dist.destroy_process_group()


def serve(provider: ExpertProvider, control, device: torch.device, hidden_size: int, top_k: int,
          dtype: torch.dtype) -> None:
    """Rank > 0: compute this rank's entries of each MoE layer step rank 0 broadcasts, and answer its calls, until
    it stops the loop. The collectives' order mirrors ShardedProvider's."""
    header = torch.zeros(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=control)
        op, layer, rows, scratch, own = header.tolist()
        if op == STOP:
            return
        if op == CALL:
            call = [None]
            dist.broadcast_object_list(call, 0, group=control)
            name, args = call[0]
            dist.gather_object(getattr(provider, name)(*args), None, dst=0, group=control)
            continue
        x = torch.empty(rows, hidden_size, dtype=dtype, device=device)
        ids = torch.empty(rows, top_k, dtype=torch.int64, device=device)
        dist.broadcast(x, 0)
        dist.broadcast(ids, 0)
        padding = Padding(own, torch.tensor([own * top_k], device=device)) if own else None
        y = x.new_empty(rows * top_k, hidden_size) if padding is None else x.new_zeros(rows * top_k, hidden_size)
        for part in provider.parts(layer, ids, x, ExpertStep(scratch=bool(scratch), padding=padding)):
            ops.expert_part(x, part, top_k, y)
        join(y, ids, provider.keep)


if __name__ == "__main__":
    _rank_main(*pickle.load(sys.stdin.buffer))
