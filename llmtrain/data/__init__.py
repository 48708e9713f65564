"""Data: corpora, tokenizers, preparation into memory-mapped token files, and batch samplers."""

from llmtrain.data.prepare import PreparedData, prepare_data
from llmtrain.data.sampler import RandomWindowSampler

__all__ = ["PreparedData", "RandomWindowSampler", "prepare_data"]
