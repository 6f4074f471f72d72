"""Speaker x-vector: mean-normalised Kaldi fbank through `campplus.onnx` (spec/frontend.md §5)."""

from __future__ import annotations

from pathlib import Path

import torch

from cosystream.frontend.audio import speaker_features
from cosystream.frontend.speech_tokenizer import build_onnx_session


class SpeakerEncoder:
    """16 kHz waveform -> CAM++ x-vector [192] (not L2-normalised; the flow does that)."""

    def __init__(self, model_path: str | Path, device: str = "cpu") -> None:
        self._session = build_onnx_session(model_path, device)
        self._input_name = self._session.get_inputs()[0].name

    def embed(self, wav_16k: torch.Tensor) -> torch.Tensor:
        """[N] float32 samples -> float32 [192]; the whole prompt is used, no cropping."""
        feats = speaker_features(wav_16k)[None]  # [1, T, 80]
        xvector = self._session.run(None, {self._input_name: feats.numpy()})[0].reshape(-1)
        return torch.from_numpy(xvector.astype("float32"))
