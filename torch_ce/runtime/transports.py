"""The transport that serves a device's windows: ``cuda.py`` (symmetric memory) on CUDA,
``host.py`` (POSIX shared memory) on CPU. Each opens a bind's new windows over its round
(``open_windows``), publishes a slot to the peers (``publish_slot``) and gives this rank's
view of a slot (``slot_local_view``).
"""
from __future__ import annotations

import torch


def transport(device: torch.device):
    """The transport module of ``device``'s windows."""
    if device.type == "cuda":
        from . import cuda

        return cuda
    from . import host

    return host
