"""Prompt speech tokens: whisper log-mel through the speech tokenizer ONNX, v2 or v3 (spec/frontend.md §4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosystream.frontend.audio import TOKENIZER_SAMPLE_RATE, whisper_log_mel

MAX_TOKENIZER_S = 30  # the v2 tokenizer was trained on windows of at most 30 s


def build_onnx_session(model_path: str | Path, device: str = "cpu", num_threads: int = 1) -> Any:
    """An onnxruntime session on CUDA when `device` is "cuda[:N]" and the CUDA provider exists, else CPU.

    One intra-op thread by default, like the official frontend: requests run concurrently in a
    thread pool, and more threads per session would oversubscribe the cores.
    """
    import onnxruntime as ort  # imported here so that importing the frontend package stays cheap

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads
    providers: list[Any] = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        device_id = int(device.partition(":")[2] or 0)
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": device_id}))
    return ort.InferenceSession(str(model_path), sess_options=options, providers=providers)


class SpeechTokenizer:
    """16 kHz waveform -> 25 Hz speech tokens in [0, 6561)."""

    def __init__(self, model_path: str | Path, device: str = "cpu") -> None:
        self._session = build_onnx_session(model_path, device)
        # PARITY: the official code addresses the inputs by position, not by name.
        self._input_names = [spec.name for spec in self._session.get_inputs()]

    def tokenize(self, wav_16k: torch.Tensor) -> torch.Tensor:
        """[N] float32 samples (N <= 30 s) -> int32 [~N/640] raw tokens, before alignment."""
        assert wav_16k.numel() <= MAX_TOKENIZER_S * TOKENIZER_SAMPLE_RATE, "checked by prepare_prompt_audio"
        feats = whisper_log_mel(wav_16k)[None]  # [1, 128, F]
        feeds = {
            self._input_names[0]: feats.numpy(),
            self._input_names[1]: np.array([feats.shape[2]], dtype=np.int32),
        }
        tokens = self._session.run(None, feeds)[0].reshape(-1)
        return torch.from_numpy(tokens.astype(np.int32))
