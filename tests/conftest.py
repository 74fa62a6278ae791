"""Test setup: 8 fake CPU devices, so every mesh in the tests fits on one machine.

The flag must be set before jax is imported anywhere.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
