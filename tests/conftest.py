"""Test setup: 8 fake CPU devices, so every mesh in the tests fits on one machine, and XLA
without LLVM's optimizations.

The tests are bound by compilation. LLVM's optimization passes take about half of XLA's CPU
compile time, and at that level XLA's fusion emitters half of the rest; every check compares
programs built with the same flags (subprocesses keep them: ``tests/xla_env.py``), so they
run unoptimized, with the elemental emitters.

One persistent XLA cache serves the whole run (``xla_cache``): the workers of pytest-xdist and
the subprocesses they start share the programs they compile, as tests build the same model or
step again on the same mesh.

The flags must be set before jax is imported anywhere (jax reads JAX_PLATFORMS when
imported, XLA its flags when the first backend starts), the XLA flags that the project's
nested shard_maps need (``dion_jax.parallel.NESTED_SHARD_MAP_XLA_FLAGS``) last.
"""
import os

import numpy  # noqa: F401  numpy's own OpenBLAS starts first, with its default threads.

from tests import xla_env

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), xla_env.FAST_COMPILE, "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxlib's CPU LAPACK calls scipy's OpenBLAS, whose threads would compete with XLA's pool.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from dion_jax.parallel import NESTED_SHARD_MAP_XLA_FLAGS  # noqa: E402  imports jax

os.environ["XLA_FLAGS"] += "".join(f" {name}={value}" for name, value in NESTED_SHARD_MAP_XLA_FLAGS.items())


import jax  # noqa: E402
import pytest  # noqa: E402

# Programs that compile faster than this are not worth a cache file (most of the suite's
# thousands of small eager programs); model initializations and steps take longer.
CACHE_MIN_COMPILE_SECS = 0.2


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory) -> str:
  """The run's persistent XLA cache, in this process and (through the environment) in every
  subprocess. Set before the worker's first compile: JAX decides once per process whether
  it uses a cache. Under pytest-xdist the workers' temporary folders share a parent."""
  base = tmp_path_factory.getbasetemp()
  path = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "xla_cache"
  path.mkdir(exist_ok=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=str(path),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(CACHE_MIN_COMPILE_SECS))
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECS)
  return str(path)


@pytest.fixture
def h100(monkeypatch):
  """Pallas' Triton kernels lower as for an H100 (tests that lower for CUDA on this CPU)."""
  from tests import triton_ir
  triton_ir.target_an_h100(monkeypatch)
