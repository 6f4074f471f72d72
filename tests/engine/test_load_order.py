"""What the engine builds first: the flow pool is sized from the GPU memory free when its runner is built, so the
runners come before the prompt analysis, whose models and CUDA graphs would otherwise shrink the pool."""

from __future__ import annotations

from cosystream.engine import async_engine
from cosystream.engine.async_engine import AsyncEngine
from cosystream.engine.prompt_batcher import PromptBatcher


def test_the_runners_are_built_before_the_prompt_analysis(model_dir, tmp_path, monkeypatch):
    built: list[str] = []
    real_runners, real_batcher = async_engine.build_runners, PromptBatcher.for_engine

    def build_runners(*args, **kwargs):
        built.append("runners")
        return real_runners(*args, **kwargs)

    def for_engine(*args, **kwargs):
        built.append("prompt analysis")
        return real_batcher(*args, **kwargs)

    monkeypatch.setattr(async_engine, "build_runners", build_runners)
    monkeypatch.setattr(PromptBatcher, "for_engine", staticmethod(for_engine))
    engine = AsyncEngine.from_pretrained(model_dir, device="cpu", voices_db=str(tmp_path / "v.db"))
    try:
        assert built == ["runners", "prompt analysis"]
        assert engine.prompt_batcher.costs() is engine.core.scheduler.prompt_costs
    finally:
        engine.close()
