"""dppo-trl: Dynamic Pruning Policy Optimization (unbiased completion pruning) for TRL's GRPO."""

from ._library_warnings import filter_library_warnings
from .config import DPPOConfig
from .trainer import DPPOTrainer

filter_library_warnings()

__all__ = ["DPPOConfig", "DPPOTrainer"]
__version__ = "0.1.0"
