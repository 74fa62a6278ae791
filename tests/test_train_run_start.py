"""The trainer's XLA flags: host devices for a CPU mesh and GPU overlap of collectives,
a value the user set winning over the trainer's."""

import os

from train.run import start
from train.run.config import Config


def test_overlap_flags_added_and_the_users_values_kept(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_all_gather=false")
  start.start_jax(Config(mesh="fs=2,tp=2"))
  flags = os.environ["XLA_FLAGS"].split()
  assert "--xla_gpu_enable_pipelined_all_gather=false" in flags
  assert not any(f.startswith("--xla_gpu_enable_pipelined_all_gather=true") for f in flags)
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
  assert "--xla_force_host_platform_device_count=4" in flags
  assert "--xla_enable_hlo_sharding_v3=false" in flags  # the pipeline's nested shard_maps, jax >= 0.11
  assert len(flags) == len(start.GPU_OVERLAP_FLAGS) + 2


def test_a_device_count_the_user_set_is_kept(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  start.start_jax(Config(mesh="fs=2"))
  assert os.environ["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=8") == 1
  assert "device_count=2" not in os.environ["XLA_FLAGS"]
