"""Gated DeltaNet (the linear-attention layers of the hybrid models), with conv and recurrent state.

Two projection layouts: qwen3_next fuses `in_proj_qkvz` / `in_proj_ba` grouped per key head;
qwen3_5_moe and qwen4_exp use separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.kernels import ops
from moestream.layers.context import StepContext
from moestream.layers.linear import Linear, Projections
from moestream.layers.norm import GatedRMSNorm
from moestream.layers.rows import RowCopies, reserve_rows, row_state


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [K-1, conv_dim]: the last inputs of the causal conv
    recurrent: torch.Tensor  # [Hv, Dk, Dv] fp32
    rows: RowCopies | None = None  # the states after each row of a verify step

    def reserve_rows(self, rows: int) -> None:
        self.rows = reserve_rows(self.rows, [self.conv, self.recurrent], rows)

    def keep(self, row: int) -> None:
        if self.rows is not None:
            self.rows.keep(row)

    def rewind(self, row: int) -> None:
        self.rows.rewind(row)

    def snapshot(self) -> DeltaNetState:
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())

    def advance(self, rows: int) -> None:
        pass  # updated in place by the forward

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def load(self, other: DeltaNetState) -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, fused_qkvz: bool, gate_activation: str = "silu"):
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.fused = fused_qkvz
        h = cfg.hidden_size
        if fused_qkvz:
            self.in_proj_qkvz = Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * self.nv, bias=False)
            self.in_proj = Projections(self.in_proj_qkvz, self.in_proj_ba)
        else:
            self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = Linear(h, self.value_dim, bias=False)
            self.in_proj_b = Linear(h, self.nv, bias=False)
            self.in_proj_a = Linear(h, self.nv, bias=False)
            self.in_proj = Projections(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))
        self.A_log = nn.Parameter(torch.empty(self.nv))
        self.dt_bias = nn.Parameter(torch.empty(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, gate_activation)
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> DeltaNetState:
        return DeltaNetState(torch.zeros(self.kernel - 1, self.conv_dim, dtype=dtype, device=device),
                             torch.zeros(self.nv, self.dk, self.dv, dtype=torch.float32, device=device))

    def fuse_projections(self) -> None:
        self.in_proj.fuse()

    def _project(self, x: torch.Tensor):
        """x [T, H] -> mixed qkv [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv]."""
        t = x.shape[0]
        if not self.fused:
            mixed, z, b, a = self.in_proj.parts(x)
            return mixed, z.reshape(t, self.nv, self.dv), b, a
        per = self.nv // self.nk  # value heads per key head
        qkvz, ba = self.in_proj.parts(x)
        q, k, v, z = qkvz.reshape(t, self.nk, -1).split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = ba.reshape(t, self.nk, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, x: torch.Tensor, state: DeltaNetState, ctx: StepContext | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; the conv and recurrent states advance in place (a captured decode graph keeps
        pointing at these buffers). A static step of several rows runs them one by one: a verify step's keeping the
        state after each, a batched step's each on its own sequence's state."""
        mixed, z, b, a = self._project(x)
        if ctx is None or not ctx.static or x.shape[0] == 1:
            return self.out_proj(self._mix(mixed, z, b, a, state))
        out = []
        for r in range(x.shape[0]):
            out.append(self._mix(mixed[r: r + 1], z[r: r + 1], b[r: r + 1], a[r: r + 1], row_state(state, r)))
            state.keep(r)
        return self.out_proj(torch.cat(out))

    def _mix(self, mixed, z, b, a, state: DeltaNetState) -> torch.Tensor:
        return ops.deltanet_step(mixed, z, b, a, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                                 self.norm.eps, self.norm.activation, state.conv, state.recurrent)
