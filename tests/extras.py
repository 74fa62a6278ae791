"""Why a test whose reference is an optional package skips where that package is missing."""
import sys

_DEV = 'needs the dev extra: pip install -e ".[dev]"'
# The dev extra pins torch to the CPU wheel of Python 3.11; for 3.12 and newer PyPI's torch is a
# multi-GB CUDA build, so the extra leaves torch (and TRL, which needs it) out there.
_NO_TORCH_HERE = ("the dev extra leaves {} out on Python 3.12 and newer (PyPI's torch is a multi-GB CUDA build"
                  " there): pip install {} to run these")
TORCH = _NO_TORCH_HERE.format("torch", "torch") if sys.version_info >= (3, 12) else _DEV
TRL = _NO_TORCH_HERE.format("TRL", "torch trl") if sys.version_info >= (3, 12) else _DEV
