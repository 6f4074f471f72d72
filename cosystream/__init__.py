"""cosystream: fast streaming inference for CosyVoice2 text-to-speech.

    from cosystream import Engine, SynthesisParams
    engine = Engine.from_pretrained("pretrained_models/CosyVoice2-0.5B", device="cuda", dtype="bfloat16")
    result = engine.synthesize(SynthesisParams(text="Hello!", prompt_audio="me.wav", prompt_text="..."))
"""

from __future__ import annotations

from typing import Any

from cosystream.config import ChunkSchedule, EngineConfig
from cosystream.outputs import AudioChunk, StageTimes, SynthesisResult
from cosystream.params import Mode, SamplingParams, SynthesisParams

__all__ = ["Engine", "AsyncEngine", "EngineConfig", "ChunkSchedule", "SynthesisParams", "SamplingParams", "Mode",
           "AudioChunk", "SynthesisResult", "StageTimes"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engines pull in torch and the models: import them only when asked for.
    if name == "Engine":
        from cosystream.engine.sync_engine import Engine

        return Engine
    if name == "AsyncEngine":
        from cosystream.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
