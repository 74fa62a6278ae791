"""Time and peak host memory of a Hugging Face export and import of a random Llama.

    python -m benchmarks.hf_io --dir /tmp/llama1b                 # Llama 3.2 1B's shape
    python -m benchmarks.hf_io --dir /tmp/llama1b --mesh fs=8     # import onto 8 CPU devices
    python -m benchmarks.hf_io --dir /tmp/llama1b --from-run      # train.export of a run

Stage 1 (its own process) draws random float32 parameters of the shape in NumPy and writes
them with ``train.store.hf.save`` (safetensors shards of at most 2 GiB and an index); stage 2
(a fresh process) reads them with ``train.store.hf.load`` on one device or onto ``--mesh``.
With ``--from-run``, stage 1 saves the drawn parameters as a run's Orbax checkpoint
(DIR.run) and stage 2 is ``train.export`` of that run into DIR, as a user exports.
Each prints wall time, the process's peak resident memory (``ru_maxrss``) and the bytes
on disk, so that peak memory can be read against the file size.
"""
import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

LLAMA_1B = {"vocab_size": 128256, "num_layers": 16, "d_model": 2048, "num_heads": 32, "num_kv_heads": 8,
                "mlp_dim": 8192, "mlp": "swiglu", "qk_norm": "none", "tie_embeddings": True, "norm_eps": 1e-5,
                "rope_base": 500000.0, "mask_vocab_padding": True, "seq_len": 2048}


def _peak_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _rss_now_gib() -> dict:
  """Resident memory now, anonymous (arrays) and file-backed (mapped safetensors pages)."""
  with open("/proc/self/status") as f:
    fields = dict(line.split(":", 1) for line in f)
  return {k: int(fields[k].split()[0]) / 2**20 for k in ("RssAnon", "RssFile") if k in fields}


def _disk_gib(directory: str) -> float:
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)) / 2**30


def _draw():
  """The model config and random float32 parameters, blocks in layer order."""
  import jax
  import numpy as np

  import models

  cfg = models.GPTConfig(**LLAMA_1B)
  shapes = models.abstract(cfg)[1]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32) * 0.02, shapes)
  params["blocks"] = jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), params["blocks"])
  return cfg, params


def save_run(run_dir: str) -> dict:
  """The drawn parameters as step 1 of a run (what train.gpt saves, optimizer state left out)."""
  import dataclasses

  from train.store import checkpoint as ckpt_lib

  cfg, params = _draw()
  record = {"train": {}, "model": dataclasses.asdict(cfg)}
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(record, f)
  start = time.perf_counter()
  checkpoints = ckpt_lib.Checkpoints(os.path.join(run_dir, "checkpoints"), keep=1, create=True)
  checkpoints.save(1, {"params": params}, {"step": 1}, record)
  checkpoints.close()
  return {"stage": "save run", "seconds": time.perf_counter() - start, "peak_rss_gib": _peak_gib()}


def export_run(run_dir: str, directory: str) -> dict:
  from train import export as export_lib

  start = time.perf_counter()
  export_lib.export(run_dir, directory)
  return {"stage": "train.export", "seconds": time.perf_counter() - start, "peak_rss_gib": _peak_gib(),
          "disk_gib": _disk_gib(directory)}


def export(directory: str) -> dict:
  from train.store import hf as hf_io

  cfg, params = _draw()
  drawn = _peak_gib()
  start = time.perf_counter()
  hf_io.save(directory, cfg, params)
  return {"stage": "export", "params": cfg.num_params(), "seconds": time.perf_counter() - start,
          "peak_rss_gib": _peak_gib(), "rss_after_drawing_gib": drawn, "disk_gib": _disk_gib(directory)}


def load(directory: str, mesh: str | None) -> dict:
  import jax

  import dion_jax
  import models
  from train.store import hf as hf_io

  cfg = hf_io.model_config(directory, seq_len=2048)
  par = models.Parallelism()
  if mesh:
    sizes = dion_jax.parse_mesh_spec(mesh)
    par = models.Parallelism(dion_jax.make_mesh(mesh, jax.devices()[:math.prod(sizes.values())]))
  start = time.perf_counter()
  _, params = hf_io.load(directory, cfg, par)
  jax.block_until_ready(params)
  return {"stage": "import", "mesh": mesh or "one device", "seconds": time.perf_counter() - start,
          "peak_rss_gib": _peak_gib(), "rss_now_gib": _rss_now_gib(), "disk_gib": _disk_gib(directory)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_io", description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", required=True, help="where to write the checkpoint (must not exist)")
  parser.add_argument("--mesh", default=None, help="import onto this mesh of CPU devices")
  parser.add_argument("--from-run", action="store_true",
                      help="save a run's checkpoint (DIR.run) and time train.export of it into DIR")
  parser.add_argument("--stage", choices=("export", "import", "save-run", "export-run"), default=None,
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.stage == "export":
    print(json.dumps(export(args.dir)))
    return 0
  if args.stage == "save-run":
    print(json.dumps(save_run(args.dir + ".run")))
    return 0
  if args.stage == "export-run":
    print(json.dumps(export_run(args.dir + ".run", args.dir)))
    return 0
  if args.stage == "import":
    print(json.dumps(load(args.dir, args.mesh)))
    return 0
  env = dict(os.environ)
  if args.mesh:

    from dion_jax.parallel import parse_mesh_spec
    count = math.prod(parse_mesh_spec(args.mesh).values())
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
  for stage in ("save-run", "export-run") if args.from_run else ("export", "import"):
    if (stage == "export" and os.path.exists(args.dir)) or (stage == "save-run" and os.path.exists(args.dir + ".run")):
      continue
    cmd = [sys.executable, "-m", "benchmarks.hf_io", "--dir", args.dir, "--stage", stage]
    subprocess.run(cmd + (["--mesh", args.mesh] if args.mesh and stage == "import" else []), check=True, env=env)
  return 0


if __name__ == "__main__":
  sys.exit(main())
