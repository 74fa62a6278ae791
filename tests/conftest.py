"""Test setup: 8 fake CPU devices, so every mesh in the tests fits on one machine.

The flags must be set before jax is imported anywhere.
"""
import os

import numpy  # noqa: F401  numpy's own OpenBLAS starts first, with its default threads.

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxlib's CPU LAPACK calls scipy's OpenBLAS, whose threads would compete with XLA's pool.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
