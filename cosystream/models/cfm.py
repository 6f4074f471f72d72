"""Conditional flow matching sampler: fixed noise table, cosine time grid, CFG pair, Euler (spec/flow.md §4).

`solve` is shared by the whole-sequence flow call and the incremental stream: the caller supplies the
velocity function (which decides what the estimator sees and caches), this module owns the numerics.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from cosystream.checkpoint.hparams import FlowDims
from cosystream.models.estimator import Estimator, chunk_attention_bias

NOISE_SEED = 0
NOISE_FRAMES = 50 * 300  # 300 s of 50 Hz frames: the longest flow call the official table allows

# velocity(step_index, x, mu, spks, cond, t) -> v; rows interleaved (conditional, unconditional) per request
_T = torch.Tensor
VelocityFn = Callable[[int, _T, _T, _T, _T, _T], _T]


def build_noise_table(num_bins: int = 80, num_frames: int = NOISE_FRAMES) -> torch.Tensor:
    """The official CFM noise [1, num_bins, num_frames] float32 (seed 0, torch's CPU generator).

    A local generator seeded 0 draws the same numbers as `torch.manual_seed(0); torch.randn(...)`
    without touching the global RNG. Bits depend on the CPU kernel (AVX2/AVX512 vs default), see
    fixtures README; the difference is < 3e-6.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(NOISE_SEED)
    return torch.randn(1, num_bins, num_frames, generator=gen, device="cpu", dtype=torch.float32)


def cosine_schedule(num_steps: int) -> tuple[list[float], list[float]]:
    """(t given to the estimator at each step, dt of each Euler step), as float32 values.

    PARITY: t is accumulated in float32 (t += dt) and dt re-derived from the grid minus that
    running t, as the official solver does, so t_k differs from the grid by rounding (dbg_est_t_all).
    """
    grid = torch.linspace(0, 1, num_steps + 1, dtype=torch.float32, device="cpu")  # also under a meta device
    grid = 1 - torch.cos(grid * 0.5 * torch.pi)
    t, dt = grid[0], grid[1] - grid[0]
    ts, dts = [], []
    for step in range(1, num_steps + 1):
        ts.append(float(t))
        dts.append(float(dt))
        t = t + dt
        if step < num_steps:
            dt = grid[step + 1] - t
    return ts, dts


def with_unconditional(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [2B, ...] with rows (x_0, 0, x_1, 0, ...): each request's CFG pair is contiguous."""
    return torch.stack([x, torch.zeros_like(x)], dim=1).flatten(0, 1)


class CausalConditionalCFM(nn.Module):
    """The flow's `decoder`: owns the estimator (keys `decoder.estimator.*`) and the noise table.

    `rand_noise` is a non-persistent buffer (not in flow.pt); tests may replace it with a stored prefix
    via `set_noise_table`.
    """

    def __init__(self, dims: FlowDims) -> None:
        super().__init__()
        self.estimator = Estimator(dims.estimator)
        self.num_bins = dims.output_size
        self.cfg_rate = dims.inference_cfg_rate
        self.t_steps, self.dt_steps = cosine_schedule(dims.n_timesteps)
        self.register_buffer("rand_noise", build_noise_table(dims.output_size), persistent=False)

    @property
    def num_steps(self) -> int:
        return len(self.t_steps)

    def set_noise_table(self, table: torch.Tensor) -> None:
        self.rand_noise = table.to(device=self.rand_noise.device, dtype=self.rand_noise.dtype)

    def noise(self, start: int, num_frames: int) -> torch.Tensor:
        """z for absolute frames [start, start + num_frames): [1, 80, num_frames] float32."""
        if start + num_frames > self.rand_noise.shape[-1]:
            raise ValueError(f"flow call needs noise frames up to {start + num_frames}, "
                             f"the table has {self.rand_noise.shape[-1]}")
        return self.rand_noise[:, :, start:start + num_frames].float()

    def solve(self, z: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              velocity: VelocityFn, fused: ModuleType | None = None) -> torch.Tensor:
        """Euler-integrate from z [B, 80, C] (float32) with CFG; returns x1 [B, 80, C] float32.

        mu, cond [B, 80, C], spks [B, 80]. The ODE state stays float32 whatever the model dtype.
        fused: ops with `project_cfg_euler` (`cosystream.kernels.flow`, or `.reference`); the velocity
        function then returns the estimator's hidden state (`Estimator.step(..., project=False)`) and the
        final projection, the CFG mix, the update and the next rows are one op.
        """
        mu_in, spks_in, cond_in = self.cfg_inputs(mu, spks, cond)
        x, rows = z.float(), None
        for k in range(self.num_steps):
            x, rows = self.step(k, x, rows, mu_in, spks_in, cond_in, velocity, fused)
        return x

    def step(self, k: int, x: torch.Tensor, rows: torch.Tensor | None, mu_in: torch.Tensor, spks_in: torch.Tensor,
             cond_in: torch.Tensor, velocity: VelocityFn, fused: ModuleType | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Euler step k of `solve`: x [B, 80, C] float32 and, with `fused`, the estimator's input rows it made
        for this step (None: made here from x) -> (x after the step, the next step's rows or None). The CFG
        inputs are `cfg_inputs`'s."""
        t_in = torch.full((2 * x.shape[0],), self.t_steps[k], device=x.device, dtype=torch.float32)
        out = velocity(k, self.cfg_rows(x) if rows is None else rows, mu_in, spks_in, cond_in, t_in)
        if fused is None:
            return self.euler_step(x, out, self.dt_steps[k]), None
        proj = self.estimator.final_proj
        return fused.project_cfg_euler(out, proj.weight, proj.bias, x.contiguous(), self.dt_steps[k], self.cfg_rate)

    def cfg_inputs(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mu, spks, cond as the estimator's CFG rows (conditional, unconditional per request), model dtype."""
        dtype = self.estimator.final_proj.weight.dtype
        return tuple(with_unconditional(a.to(dtype)) for a in (mu, spks, cond))  # type: ignore[return-value]

    def cfg_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The ODE state [B, 80, C] as the estimator's 2B input rows (model dtype)."""
        return x.repeat_interleave(2, dim=0).to(self.estimator.final_proj.weight.dtype)

    def euler_step(self, x: torch.Tensor, v: torch.Tensor, dt: float | torch.Tensor) -> torch.Tensor:
        """x + dt · CFG-combined velocity; v [2B, 80, C] from cfg_rows(x). dt: a float or a float32 scalar
        tensor (a graph replayed at every step reads it from the device; the product is the same)."""
        v = v.float()
        v_cond, v_uncond = v[0::2], v[1::2]
        # PARITY: v = (1 + λ)·v_c − λ·v_u, then x += dt·v, in float32 (spec/flow.md §4).
        return x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)

    def sample(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool
               ) -> torch.Tensor:
        """Whole-sequence sampling as the official flow: mu, cond [B, 80, F]; spks [B, 80] -> [B, 80, F]."""
        batch, _, num_frames = mu.shape
        est = self.estimator
        kv, conv_state = est.new_cache(2 * batch, num_frames, device=mu.device)
        pos = torch.arange(num_frames, device=mu.device)
        bias = chunk_attention_bias(pos, num_frames, est.dims.static_chunk_size if streaming else 0, kv.dtype)

        def velocity(k: int, x: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                     t: torch.Tensor) -> torch.Tensor:
            conv_state.zero_()  # every Euler step starts at frame 0 (official left zero padding)
            return est.step(x, mu, spks, cond, t, [kv], conv_state, pos.unsqueeze(0), [bias])

        z = self.noise(0, num_frames).expand(batch, -1, -1)
        return self.solve(z, mu, spks, cond, velocity)
