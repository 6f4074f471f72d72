"""CosyVoice3 (Fun-CosyVoice3-0.5B) models: the LM head and ids, the DiT flow and the causal HiFT.

spec/cosyvoice3.md. The Qwen2 backbone, the RAS sampler and the CFM numerics are shared with CosyVoice2.
"""
