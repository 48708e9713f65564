"""torchao, imported without its noise: its import logs a warning for each C++ extension it cannot
load (kernels for formats llmtrain does not use), and a compiled step warns that its tensor types
have no stable hash for AOT autograd's cache (it compiles anyway). Neither concerns the 8-bit
optimizers (engine/optim.py) or the NF4 weights (qlora.py), which both import it through here."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """torchao's loggers at ERROR inside; afterwards their levels as they were, and AOT autograd's
    stable-hash note filtered for the rest of the process."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
