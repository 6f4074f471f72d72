"""Random-weight ONNX side models with the released models' architectures, for op coverage and timings.

The fixture sets and `onnx_standins` ship tiny graphs that only have the official inputs and outputs. These
build the architectures themselves in torch, with random weights, and export them with the TorchScript ONNX
exporter (as the released files were made), so the torch runner (`frontend/onnx_torch.py`) meets the operators
and the shape arithmetic of a real export, and the GPU cost of the prompt analysis can be measured at full size:

* the speech tokenizer (v2 of CosyVoice2, v3 of CosyVoice3): a Whisper-style encoder on the 128-bin log-mel,
  two stride-2 convolutions (4 frames per token), attention blocks whose value path also runs through a
  depthwise FSMN memory (kernel 31), rotary positions on 64-wide heads, a length mask from `feats_length`,
  and an FSQ head (8 digits in base 3 from tanh of a projection). Full size: 1280 wide, 20 heads, 6 blocks
  (v2) or 12 (v3), ≈ 0.5 / 1 GB of float32; the layout is the one the `s3tokenizer` package loads the
  released files into (checked against s3tokenizer 0.3.0: the same parameters up to their names, and the
  same tokens from the same weights, batched with padding, for v2 and v3);
* CAM++ (3D-Speaker's CAMPPlus, CosyVoice's `campplus.onnx`): a 2D-convolution head with residual blocks
  over the 80 fbank bins (FCM), a stride-2 TDNN, three densely connected TDNN blocks (12/24/16 layers,
  growth 32) whose layers gate their output by context-aware masking (global mean plus 100-frame segment
  means), transition layers, statistics pooling (mean and standard deviation) and a 192-dim embedding.
  ≈ 7 M parameters (checked against speakerlab 0.0.6's CAMPPlus with a 192-dim embedding: the same
  parameters in the same order, and the same output from the same weights).

Interfaces as released: `feats` [1, 128, T] float32 + `feats_length` [1] int32 -> `indices` [1, ceil(T/4)]
int64; `input` [1, T, 80] float32 -> `output` [1, 192] float32. `size="small"` keeps every layer type with
fewer channels and layers (CPU tests); `size="full"` is the released model's size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cosystream.frontend.audio import voiced_signal, whisper_log_mel

HEAD_DIM = 64  # the rotary table's width: heads are 64 wide at every size
FSMN_KERNEL = 31
CALIBRATION_SECONDS = 4.0
ROTARY_POSITIONS = 2048  # 25 Hz positions the rotary table covers (82 s of prompt)
FSQ_LEVELS = 3
FSQ_DIGITS = 8  # 3**8 = 6561 speech tokens
FSQ_SHRINK = 0.999  # tanh output scaled inside (-1, 1) before rounding to {-1, 0, 1}
FSQ_SPREAD = 0.8  # calibrated std of the projection: about a quarter of frames per digit at each end
MASK_BIAS = -1.0e10  # attention bias of padded frames
SEGMENT_FRAMES = 100  # CAM++ context: means over segments of 100 fbank frames
EXPORT_OPSET = {"v2": 17, "v3": 15, "campplus": 13}  # v3 before opset 17: its layer norms decompose


@dataclass(frozen=True)
class TokenizerDims:
    width: int
    layers: int

    @property
    def heads(self) -> int:
        return self.width // HEAD_DIM


@dataclass(frozen=True)
class CamDims:
    fcm_channels: int = 32
    init_channels: int = 128
    growth: int = 32
    block_layers: tuple[int, int, int] = (12, 24, 16)
    embedding: int = 192


TOKENIZER_SIZES = {("v2", "full"): TokenizerDims(1280, 6), ("v3", "full"): TokenizerDims(1280, 12),
                   ("v2", "small"): TokenizerDims(128, 2), ("v3", "small"): TokenizerDims(128, 3)}
CAM_SIZES = {"full": CamDims(), "small": CamDims(fcm_channels=8, init_channels=32, growth=8, block_layers=(2, 3, 2))}


# ---------------------------------------------------------------------------------------------- speech tokenizer
def _rotary_tables(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, 64]: rotary positions by halves (the second half negated in front)."""
    first, second = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class _FsmnAttention(nn.Module):
    """Self-attention (q and k each scaled by head_dim^-1/4, keys without bias) plus an FSMN memory: a
    depthwise convolution over the masked values, added to them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = width // HEAD_DIM
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.fsmn = nn.Conv1d(width, width, FSMN_KERNEL, groups=width, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q = _rotate(self.query(x).view(b, t, self.heads, HEAD_DIM), cos, sin)
        k = _rotate(self.key(x).view(b, t, self.heads, HEAD_DIM), cos, sin)
        v = self.value(x)
        kept = v * keep
        side = (FSMN_KERNEL - 1) // 2
        memory = (self.fsmn(F.pad(kept.transpose(1, 2), (side, side))).transpose(1, 2) + kept) * keep
        scale = HEAD_DIM ** -0.25
        scores = (q.transpose(1, 2) * scale) @ (k.permute(0, 2, 3, 1) * scale) + bias
        heads = torch.softmax(scores, dim=-1) @ v.view(b, t, self.heads, HEAD_DIM).transpose(1, 2)
        return self.out(heads.transpose(1, 2).reshape(b, t, width)) + memory


class _TokenizerBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn_ln = nn.LayerNorm(width)
        self.attn = _FsmnAttention(width)
        self.mlp_ln = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), bias, keep, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


def _halved(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after a kernel-3, stride-2, pad-1 convolution: ceil(n / 2)."""
    return torch.div(lengths - 1, 2, rounding_mode="floor") + 1


class SpeechTokenizerNet(nn.Module):
    """feats [B, 128, T] + feats_length [B] -> speech tokens [B, ceil(T/4)] (rows past a prompt's own
    ceil(length/4) are padding)."""

    def __init__(self, dims: TokenizerDims, mels: int = 128) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(mels, dims.width, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(dims.width, dims.width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(_TokenizerBlock(dims.width) for _ in range(dims.layers))
        self.project_down = nn.Linear(dims.width, FSQ_DIGITS)
        cos, sin = _rotary_tables(ROTARY_POSITIONS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("powers", FSQ_LEVELS ** torch.arange(FSQ_DIGITS, dtype=torch.float32),
                             persistent=False)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        digits = torch.round(torch.tanh(self.project_down(self.encode(feats, feats_length))) * FSQ_SHRINK) + 1
        return (digits * self.powers).sum(dim=-1).to(torch.int64)

    def encode(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        """[B, 128, T] -> the hidden states the FSQ head reads, [B, ceil(T/4), width]."""
        lengths = feats_length.to(torch.int64)
        x = feats * _keep(lengths, feats.shape[-1])[:, None, :]
        x = F.gelu(self.conv1(x))
        lengths = _halved(lengths)
        x = F.gelu(self.conv2(x * _keep(lengths, x.shape[-1])[:, None, :]))
        lengths = _halved(lengths)
        keep = _keep(lengths, x.shape[-1])  # [B, N]
        x = x.transpose(1, 2)
        n = x.shape[1]
        cos, sin = self.cos[:n][None, :, None, :], self.sin[:n][None, :, None, :]
        bias = ((1.0 - keep) * MASK_BIAS)[:, None, None, :]
        keep = keep[:, :, None]
        for block in self.blocks:
            x = block(x, bias, keep, cos, sin)
        return x

    @torch.no_grad()
    def calibrate(self, feats: torch.Tensor) -> None:
        """Scale and centre the FSQ projection on speech-like features [1, 128, T], so each digit's three
        values are all used (a trained tokenizer spreads its codes; a random one would give a few)."""
        hidden = self.encode(feats, torch.tensor([feats.shape[-1]]))[0]
        projected = self.project_down(hidden)
        mean, std = projected.mean(dim=0), projected.std(dim=0).clamp_min(1e-6)
        gain = FSQ_SPREAD / std
        self.project_down.weight.mul_(gain[:, None])
        self.project_down.bias.copy_((self.project_down.bias - mean) * gain)


def _keep(lengths: torch.Tensor, frames: int) -> torch.Tensor:
    """1.0 on each row's first `lengths` frames, 0.0 after (float, [B, frames])."""
    return (torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]).to(torch.float32)


# ---------------------------------------------------------------------------------------------- CAM++
def _bn_relu(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm1d(channels), nn.ReLU())


class _ResBlock2d(nn.Module):
    """The FCM head's residual block: two 3x3 convolutions, the first strided over frequency only."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1:
            self.shortcut = nn.Sequential(nn.Conv2d(channels, channels, 1, stride=(stride, 1), bias=False),
                                          nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _Fcm(nn.Module):
    """[B, 80, T] fbank -> [B, C * 10, T]: 2D convolutions over (frequency, time), frequency strided 8x."""

    def __init__(self, channels: int, bins: int = 80) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(_ResBlock2d(channels, 2), _ResBlock2d(channels, 1))
        self.layer2 = nn.Sequential(_ResBlock2d(channels, 2), _ResBlock2d(channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.out_channels = channels * (bins // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x[:, None])))
        out = F.relu(self.bn2(self.conv2(self.layer2(self.layer1(out)))))
        return out.reshape(out.shape[0], out.shape[1] * out.shape[2], out.shape[3])


class _CamLayer(nn.Module):
    """A local convolution gated by a sigmoid mask computed from context: the utterance mean plus the mean
    of each frame's 100-frame segment."""

    def __init__(self, channels: int, out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.local = nn.Conv1d(channels, out, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation,
                               bias=False)
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        segments = F.avg_pool1d(x, SEGMENT_FRAMES, SEGMENT_FRAMES, ceil_mode=True)
        per_frame = segments[..., None].expand(*segments.shape, SEGMENT_FRAMES)
        per_frame = per_frame.reshape(*segments.shape[:-1], -1)[..., :frames]
        context = x.mean(dim=-1, keepdim=True) + per_frame
        mask = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.local(x) * mask


class _DenseLayer(nn.Module):
    def __init__(self, channels: int, growth: int, kernel: int, dilation: int) -> None:
        super().__init__()
        bottleneck = 4 * growth
        self.pre = _bn_relu(channels)
        self.linear = nn.Conv1d(channels, bottleneck, 1, bias=False)
        self.mid = _bn_relu(bottleneck)
        self.cam = _CamLayer(bottleneck, growth, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.cam(self.mid(self.linear(self.pre(x))))], dim=1)


class CamPlusNet(nn.Module):
    """input [B, T, 80] (mean-normalised fbank) -> [B, 192] speaker embedding."""

    def __init__(self, dims: CamDims) -> None:
        super().__init__()
        self.head = _Fcm(dims.fcm_channels)
        channels = dims.init_channels
        layers: list[nn.Module] = [nn.Conv1d(self.head.out_channels, channels, 5, stride=2, padding=2, bias=False),
                                   nn.BatchNorm1d(channels), nn.ReLU()]
        for count, dilation in zip(dims.block_layers, (1, 2, 2), strict=True):
            for i in range(count):
                layers.append(_DenseLayer(channels + i * dims.growth, dims.growth, 3, dilation))
            channels += count * dims.growth
            layers += [nn.BatchNorm1d(channels), nn.ReLU(), nn.Conv1d(channels, channels // 2, 1, bias=False)]
            channels //= 2
        layers += [nn.BatchNorm1d(channels), nn.ReLU()]
        self.xvector = nn.Sequential(*layers)
        self.embed = nn.Conv1d(2 * channels, dims.embedding, 1, bias=False)
        self.embed_norm = nn.BatchNorm1d(dims.embedding, affine=False)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = self.xvector(self.head(feats.transpose(1, 2)))
        stats = torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)
        return self.embed_norm(self.embed(stats[..., None]))[..., 0]


# ---------------------------------------------------------------------------------------------- weights, export
def randomise(module: nn.Module, seed: int) -> nn.Module:
    """Seeded random weights (fan-in scaled kernels, small biases, norms near identity with random running
    statistics, as a trained model has), eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if not tensor.dtype.is_floating_point:
                continue
            noise = torch.randn(tensor.shape, generator=gen)
            if name.endswith("running_var"):
                tensor.copy_(1.0 + 0.1 * noise.abs())
            elif name.endswith("running_mean") or name.endswith("bias"):
                tensor.copy_(0.05 * noise)
            elif tensor.ndim == 1:  # norm gains
                tensor.copy_(1.0 + 0.1 * noise)
            else:
                fan_in = tensor[0].numel()
                tensor.copy_(noise / math.sqrt(fan_in))
    return module.eval()


def speech_tokenizer_net(version: str, size: str, seed: int) -> SpeechTokenizerNet:
    if (version, size) not in TOKENIZER_SIZES:
        raise ValueError(f"speech tokenizer: version v2 or v3, size full or small, got {version!r}, {size!r}")
    net = randomise(SpeechTokenizerNet(TOKENIZER_SIZES[(version, size)]), seed)
    assert isinstance(net, SpeechTokenizerNet)
    net.calibrate(whisper_log_mel(voiced_signal(CALIBRATION_SECONDS, 16000, seed))[None])
    return net


def campplus_net(size: str, seed: int) -> CamPlusNet:
    if size not in CAM_SIZES:
        raise ValueError(f"campplus: size full or small, got {size!r}")
    return randomise(CamPlusNet(CAM_SIZES[size]), seed)  # type: ignore[return-value]


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[str], output: str, dynamic: dict,
            opset: int) -> None:
    path.unlink(missing_ok=True)  # a link (a model directory linked to another's files) is replaced, not followed
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and tracer notes
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=[output], dynamic_axes=dynamic,
                          opset_version=opset, dynamo=False, do_constant_folding=True)
    _declare_batch_of_one(path)


def _declare_batch_of_one(path: Path) -> None:
    """The exporter names the output's batch axis as a symbol; the released files declare 1 (as their inputs)."""
    import onnx

    model = onnx.load(str(path))
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(model, str(path))


def write_speech_tokenizer(path: str | Path, version: str = "v2", size: str = "full", seed: int = 0) -> Path:
    """The tokenizer at `path` (.onnx): feats [1,128,T] float32 + feats_length [1] int32 -> indices [1,N] int64."""
    path = Path(path)
    net = speech_tokenizer_net(version, size, seed)
    feats = torch.randn(1, 128, 203, generator=torch.Generator().manual_seed(seed))
    _export(net, (feats, torch.tensor([203], dtype=torch.int32)), path, ["feats", "feats_length"], "indices",
            {"feats": {2: "T"}, "indices": {1: "N"}}, EXPORT_OPSET[version])
    return path


def write_campplus(path: str | Path, size: str = "full", seed: int = 0) -> Path:
    """CAM++ at `path` (.onnx): input [1,T,80] float32 -> output [1,192] float32."""
    path = Path(path)
    net = campplus_net(size, seed)
    feats = torch.randn(1, 251, 80, generator=torch.Generator().manual_seed(seed))
    _export(net, (feats,), path, ["input"], "output", {"input": {1: "T"}}, EXPORT_OPSET["campplus"])
    return path


def replace_side_models(model_dir: str | Path, size: str = "full", seed: int = 0) -> list[Path]:
    """Overwrite a model directory's speech tokenizer (its version kept) and CAM++ with these graphs."""
    model_dir = Path(model_dir)
    tokenizers = sorted(model_dir.glob("speech_tokenizer_v*.onnx"))
    if len(tokenizers) != 1 or tokenizers[0].stem[-2:] not in ("v2", "v3"):
        raise FileNotFoundError(f"{model_dir}: expected one speech_tokenizer_v2.onnx or speech_tokenizer_v3.onnx")
    version = tokenizers[0].stem[-2:]
    return [write_speech_tokenizer(tokenizers[0], version, size, seed),
            write_campplus(model_dir / "campplus.onnx", size, seed + 1)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Replace a model directory's speech tokenizer and CAM++ with "
                                                 "random-weight graphs of the released architectures.")
    parser.add_argument("model_dir")
    parser.add_argument("--size", default="full", choices=["full", "small"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        written = replace_side_models(args.model_dir, args.size, args.seed)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
