"""dppo-trl: Dynamic Pruning Policy Optimization (unbiased completion pruning) for TRL's GRPO.

``DPPOConfig`` and ``DPPOTrainer`` load on first use: ``dppo-trl --help`` imports the config alone, not the trainer
and what it brings (datasets, pandas, rich)."""

from typing import TYPE_CHECKING

from ._library_warnings import filter_library_warnings
from ._version import __version__

if TYPE_CHECKING:
    from .config import DPPOConfig
    from .trainer import DPPOTrainer

filter_library_warnings()

__all__ = ["DPPOConfig", "DPPOTrainer", "__version__"]


def __getattr__(name: str):
    if name == "DPPOConfig":
        from .config import DPPOConfig

        return DPPOConfig
    if name == "DPPOTrainer":
        from .trainer import DPPOTrainer

        return DPPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
