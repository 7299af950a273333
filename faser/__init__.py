"""FASER serve: adaptive speculative decoding. `faser.LLM` is the offline entry point."""

from faser.config import EngineConfig, SpecConfig
from faser.outputs import RequestOutput, SpecStats
from faser.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "SpecConfig", "SpecStats"]


def __getattr__(name: str):
    # the engine pulls in torch and transformers: load it on first use only
    if name == "LLM":
        from faser.llm import LLM

        return LLM
    raise AttributeError(name)
