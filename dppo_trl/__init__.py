"""dppo-trl: Dynamic Pruning Policy Optimization (unbiased completion pruning) for TRL's GRPO."""

from .config import DPPOConfig
from .trainer import DPPOTrainer

__all__ = ["DPPOConfig", "DPPOTrainer"]
__version__ = "0.1.0"
