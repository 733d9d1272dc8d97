"""The FutureWarnings a plain run prints that are not the user's to act on, filtered once, at import.

transformers 5.23 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*`` and warns from its own
modules on every use of an old name. TRL 1.16 uses the old names itself: ``GRPOConfig``'s default
``gradient_checkpointing=True`` and the calls around each generation (``trl.models.utils``). The new names do not
exist in the transformers 5.0 to 5.22 that dppo-trl supports, so a user has nothing to change. The filter names
those messages and the two modules that issue them: every other warning, the user's own included, still shows.
The same message from a user's own call, such as ``model.gradient_checkpointing_enable()``, is hidden too: the
warning names transformers' module, not its caller.
A user who sets warning filters (``python -W``, ``PYTHONWARNINGS``) sees what they ask for: then nothing is filtered.
"""

from __future__ import annotations

import sys
import warnings

# (message at the start, issuing module), as warnings.filterwarnings matches them.
LIBRARY_FUTURE_WARNINGS = (
    (
        r"`(is_)?gradient_checkpointing(_enable|_disable|_kwargs)?` is deprecated and will be removed in v6",
        r"transformers\.(modeling_utils|training_args)\Z",
    ),
)


def filter_library_warnings() -> None:
    """Hide ``LIBRARY_FUTURE_WARNINGS``, unless the command line or the environment set warning filters."""
    if sys.warnoptions:
        return
    for message, module in LIBRARY_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
