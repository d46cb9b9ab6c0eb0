"""The test suite's own switches, read once, here (torch_ce never reads them).

    TORCH_CE_SLOW=1             the long cases (``@pytest.mark.slow``, the long fuzz)
    TORCH_CE_FUZZ_TRIALS        trials per spawned disagreement-fuzz run (default 6)
    TORCH_CE_SLOW_FUZZ_TRIALS   the long fuzz's trials per world size (default 200)
    TORCH_CE_GPU_WORLD          ranks of the multi-GPU tests (default 2)
    TORCH_CE_RUN_SLOW           slow cases to run all the same (comma-separated globs over
                                pytest node ids; CI's fast legs: the slow cases they own)
    TORCH_CE_NO_SKIP            files (comma-separated globs) none of whose default cases may
                                skip, unless for a reason ``conftest.ALLOWED_SKIPS`` lists
                                (CI's legs: the graph_trainer files)

``conftest.py`` imports this module before anything imports torch_ce, and the values leave
``os.environ`` here: torch_ce reads its ``TORCH_CE_*`` configuration at import and warns
about names it does not know, and these are not its configuration. Ranks spawned by the
tests inherit the cleaned environment and get what they need through their arguments.
"""
from __future__ import annotations

import os

NAMES = ("TORCH_CE_SLOW", "TORCH_CE_FUZZ_TRIALS", "TORCH_CE_SLOW_FUZZ_TRIALS", "TORCH_CE_GPU_WORLD",
         "TORCH_CE_NO_SKIP", "TORCH_CE_RUN_SLOW")
_raw = {n: os.environ.pop(n) for n in NAMES if n in os.environ}

SLOW = _raw.get("TORCH_CE_SLOW", "") not in ("", "0")
FUZZ_TRIALS = int(_raw.get("TORCH_CE_FUZZ_TRIALS", "6"))
SLOW_FUZZ_TRIALS = int(_raw.get("TORCH_CE_SLOW_FUZZ_TRIALS", "200"))
GPU_WORLD = int(_raw.get("TORCH_CE_GPU_WORLD", "2"))
NO_SKIP = tuple(g for g in _raw.get("TORCH_CE_NO_SKIP", "").split(",") if g)
RUN_SLOW = tuple(g for g in _raw.get("TORCH_CE_RUN_SLOW", "").split(",") if g)
