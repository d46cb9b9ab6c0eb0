"""Make ``torch_ce`` importable from the source tree when it is not pip-installed."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import torch_ce  # noqa: F401
except ImportError:
    sys.path.insert(0, _ROOT)
