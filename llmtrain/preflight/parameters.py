"""A model's parameters, counted three ways, each under one name wherever it is shown: the run's
banner, the pre-flight check, the run's `start` record and its report.

    total                        every unique parameter (a tied head once): what the built model holds
    without the position table   less the learned position table (none under RoPE): nanoGPT's count
    without embeddings           less the token and position tables: the N of "~20 tokens per parameter"

Imports no torch: the report formats the counts a run recorded without loading it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtrain.model_tensors import ModelTensors

TOTAL, WITHOUT_POSITIONS, WITHOUT_EMBEDDINGS = "total", "without the position table", "without embeddings"


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    without_positions: int
    without_embeddings: int

    def text(self) -> str:
        """'858,880 total, 826,112 without the position table, 793,344 without embeddings'; a model
        without a position table (RoPE) leaves out the count that would repeat the total."""
        parts = [f"{self.total:,} {TOTAL}"]
        if self.without_positions != self.total:
            parts.append(f"{self.without_positions:,} {WITHOUT_POSITIONS}")
        parts.append(f"{self.without_embeddings:,} {WITHOUT_EMBEDDINGS}")
        return ", ".join(parts)

    def tokens_per_param(self, tokens: int) -> float:
        """Tokens per parameter without embeddings: the figure compute-optimal training (~20) reads."""
        return tokens / max(1, self.without_embeddings)

    def record(self) -> dict[str, int]:
        """The counts as the `start` record of metrics.jsonl keeps them."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> ParameterCounts | None:
        """The counts a `start` record kept; None when it has none (a run from before they were kept)."""
        if not isinstance(record, dict):
            return None
        try:
            return cls(**{name: int(record[name]) for name in ("total", "without_positions", "without_embeddings")})
        except (KeyError, TypeError, ValueError):
            return None


def parameter_counts(tensors: ModelTensors) -> ParameterCounts:
    """The three counts of a model config's tensors (model_tensors.py: nothing is built)."""
    def table(name: str) -> int:
        return math.prod(tensors.outside[name]) if name in tensors.outside else 0

    positions = table("wpe.weight")
    return ParameterCounts(tensors.n_params, tensors.n_params - positions,
                           tensors.n_params - positions - table("wte.weight"))


def trainable_text(trainable: int, total: int) -> str:
    """'12,288 trainable parameters (1.41% of 871,168)': a LoRA run's adapters against the whole model."""
    return f"{trainable:,} trainable parameters ({trainable / max(1, total):.2%} of {total:,})"
