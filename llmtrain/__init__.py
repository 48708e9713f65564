"""llmtrain: train GPT-style language models from composable Hydra config groups."""

__version__ = "0.1.0"
