"""moestream: run Mixture-of-Experts language models larger than GPU memory.

The public API: `LLM`, `SamplingParams`, `EngineConfig` (imported on first use, so the CLI starts fast)."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "ExpertConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from moestream.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moestream.sampling import SamplingParams

        return SamplingParams
    if name in ("EngineConfig", "ExpertConfig"):
        from moestream import config

        return getattr(config, name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
