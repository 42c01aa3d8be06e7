"""The one door through which the executor imports torch.

The simulator must work without torch, so the executor imports it lazily, and
only through here: a missing install then reads as one line with the fix.
"""

from __future__ import annotations

from types import ModuleType

from parsim.errors import ParsimError

INSTALL_HINT = "torch is not installed: pip install torch==2.13.0 && pip install -e '.[executor]'"


def require_torch() -> ModuleType:
    """``torch``, or a :class:`ParsimError` that says how to install it."""
    try:
        import torch
    except ImportError:
        raise ParsimError(INSTALL_HINT) from None
    return torch


def require_distributed() -> ModuleType:
    """``torch.distributed``, or a :class:`ParsimError` if this build lacks it."""
    require_torch()
    import torch.distributed as dist

    if not dist.is_available():
        raise ParsimError("this torch build has no torch.distributed (install a standard build of torch)")
    return dist
