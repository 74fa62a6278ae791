"""The environment of the tests' subprocesses: conftest's XLA flags without its device count."""
import os
from importlib import metadata


def _jaxlib_older_than(version: tuple[int, int]) -> bool:
  """Read off the installed distribution: the flags must be set before jax is imported."""
  return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2]) < version


# Without LLVM's optimizations, and with XLA's elemental emitters, which compile in half the time
# of its fusion emitters at this level. jaxlib 0.11 dropped the emitters' flag (XLA:CPU keeps
# only its fusion emitters) and aborts the process on a flag it does not know. LLVM's module
# in one piece: split (32 parts by default) and compiled on threads, it cost more CPU, which
# two test workers on two cores do not have to spare (a trainer step's set-up, tiny shrunk, on
# rp=2,fs=2,tp=2 and fs=2,tp=2,pp=2: XLA's compiles 5.9 s of CPU against 7.3, the medians of
# 7 interleaved runs each on a shared machine; /tmp/cflags/run.py in the commit's message).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_parallel_codegen_split_count=1"
                + (" --xla_cpu_use_fusion_emitters=false" if _jaxlib_older_than((0, 11)) else ""))


def subprocess_env(drop: tuple[str, ...] = ()) -> dict:
  """``os.environ`` less ``drop``, its XLA_FLAGS less the forced device count (a subprocess
  asks for its own)."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags)
  return env
