"""Plan a training step on a mesh beyond this machine: bytes, time and memory per device.

    python -m train.plan --model 8b --mesh fs=64,tp=8 --global-batch-size 512
    python -m train.plan --model 405b --mesh rp=16,fs=8,tp=8 --optimizer dion --rank-fraction 0.0625 --json
    python -m train.plan --model 70b --devices 1024 --sweep

Bytes (``train.run.plan.model``, ``train.run.plan.optimizer``) are this repository's
step as XLA partitions it, checked against compiled steps on CPU meshes by
``tests/test_train_plan.py``. Time is an estimate on top of them:

- compute: the model's 6·N·tokens + attention flops (``GPTConfig.flops_per_token``) and
  the optimizer's matrix products, at ``--mfu`` of the GPU's peak (bf16 dense);
- communication: per collective, ring algorithms under an alpha-beta link model: an
  all-reduce over g devices sends 2(g−1)/g of its payload in 2(g−1) steps, the others
  (g−1)/g in g−1 steps (a collective-permute its payload in one), each step paying the
  link's latency α, the bytes at its bandwidth β. An axis whose groups fit in one node
  (``--gpus-per-node``, axes later in rp,fs,ep,cp,tp,pp are closer) runs on NVLink, else
  on InfiniBand (``--nvlink``, ``--ib``: bandwidth and latency); ``--links tp=nvlink,fs=ib``
  overrides. An all-reduce takes a binary
  tree (2·log2 g steps, twice its payload on the wire) when that is faster. Nothing is overlapped (an upper
  bound); the overlapped bound max(compute, communication) is printed beside it;
- the pipeline bubble: (pp−1)/(M+pp−1) of the step with M micro-batches.

- recomputation: the forward products the recompute policy (``--remat POLICY``, the
  trainer's) does not keep, once more (``train.run.plan.memory.recompute_flops``), at the same MFU;
- offload: what the step moves between host and device (the offloaded residuals, the
  optimizer state with ``--offload-optimizer``), both ways, at the GPU's host link.

Memory per device (``train.run.plan.memory``): device and host apart, for the trainer's
``--remat POLICY``, ``--offload-optimizer`` and ``--loss-chunk``: parameters, gradients,
optimizer state, the residuals the policy keeps (named), the loss and the backward pass's
transient peak, checked against the compiled step's ``memory_analysis()`` on CPU meshes of
every kind (``tests/test_train_run_plan_memory.py``: never below it, at most 25% above).
``--sweep`` picks, for each mesh, the fastest policy and offload that fit.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import models
from models import remat
from dion_jax.parallel.mesh import AXES, format_mesh_spec
from train.run.plan import grpo as plan_grpo
from train.run.plan import memory as plan_memory
from train.run.plan import model as plan_model
from train.run.plan import optimizer as plan_optimizer
from train.run.config import Config
from train.run.optim import default_rank_fraction

TRAINER = Config()  # the trainer's defaults, which the planner's are


class GPU(NamedTuple):
  peak_flops: float  # dense bf16, flop/s
  hbm_bytes: float
  hbm_bandwidth: float  # bytes/s
  host_bandwidth: float  # bytes/s each way between host and device (PCIe 5 x16; B200: NVLink-C2C in GB200 aside)


GPUS = {  # NVIDIA's data sheets (SXM)
    "h100": GPU(989e12, 80e9, 3.35e12, 55e9),
    "h200": GPU(989e12, 141e9, 4.8e12, 55e9),
    "b200": GPU(2250e12, 180e9, 8e12, 55e9),
}


class Link(NamedTuple):
  bandwidth: float  # bytes/s per device and direction
  latency: float  # seconds per ring step


LINKS = {"nvlink": Link(450e9, 5e-6), "ib": Link(50e9, 10e-6)}  # NVLink 4 (H100); 400 Gb/s NDR per GPU


def wire_bytes_and_steps(op: str, payload: int, g: int) -> tuple[float, int]:
  if op == "collective-permute":
    return payload, 1
  if op == "all-reduce":
    return 2 * (g - 1) / g * payload, 2 * (g - 1)
  return (g - 1) / g * payload, g - 1


def axis_links(sizes: dict[str, int], per_node: int, overrides: dict[str, str]) -> dict[str, str]:
  """nvlink for an axis whose groups stay inside a node, else ib (``overrides`` win)."""
  out, inner = {}, 1
  for axis in reversed(AXES):
    inner *= sizes[axis]
    out[axis] = overrides.get(axis, "nvlink" if inner <= per_node else "ib")
  return out


def collective_time(c: plan_model.Collective, sizes, links, network: dict[str, Link] = LINKS) -> float:
  """Seconds of ``c`` on the slowest link of its axes: ring, or for an all-reduce a
  (double binary) tree when that is faster (small payloads on many devices)."""
  g = plan_model.group(sizes, c.axes)
  wire, steps = wire_bytes_and_steps(c.op, c.bytes, g)
  link = min((network[links[a]] for a in c.axes), key=lambda l: l.bandwidth)
  ring = c.count * steps * link.latency + wire / link.bandwidth
  if c.op != "all-reduce":
    return ring
  return min(ring, c.count * 2 * math.ceil(math.log2(g)) * link.latency + 2 * c.bytes / link.bandwidth)


def merged(collectives: list[plan_model.Collective]) -> list[plan_model.Collective]:
  """One entry per (purpose, op, axes), bytes and counts summed."""
  out: dict[tuple, plan_model.Collective] = {}
  for c in collectives:
    key = (c.purpose, c.op, c.axes)
    old = out.get(key)
    out[key] = c if old is None else old._replace(bytes=old.bytes + c.bytes, count=old.count + c.count)
  return list(out.values())


def plan(model: str | models.GPTConfig = "small", mesh: str | dict = "", optimizer: str = TRAINER.optimizer,
         rank_fraction: float | None = None, fraction: float = 0.25, global_batch: int = 0,
         micro: int | None = None, seq_len: int | None = None, gpu: str = "h100", per_node: int = 8,
         links: dict[str, str] | None = None, mfu: float = 0.5, dtype: str = "bfloat16", compare: bool = True,
         network: dict[str, Link] = LINKS, remat: str = "none", offload_optimizer: bool = False,
         loss_chunk: int | None = None, grpo: plan_grpo.GRPO | None = None, split_q: bool = False,
         megabatch_bytes: int | None = None) -> dict[str, Any]:
  """The plan of one step as a JSON-ready dict (see the module docstring); ``links``
  overrides the link kind of some axes, ``network`` the kinds' bandwidth and latency;
  ``split_q`` Dion's Q split over the row axes (``--dion-split-q``); ``megabatch_bytes``
  the matrix optimizers' chunks stepped one after another (``--megabatch-mib``).
  Defaults are ``python -m train.gpt``'s (Dion at its default rank for the model's width,
  ``train.run.optim.default_rank_fraction``; Dion2's fraction 1/4) on a GPU (bfloat16
  activations). With ``grpo`` the step is GRPO's: its rollout (``train.run.plan.grpo``) and
  an update on its prompts x group sequences of prompt + completion tokens."""
  if grpo is not None:
    global_batch, seq_len = grpo.sequences, grpo.length
  cfg = plan_model.load_config(model, seq_len, dtype)
  sizes = plan_model.sizes_of(mesh)
  devices = math.prod(sizes.values())
  if gpu not in GPUS:
    raise ValueError(f"--gpu {gpu}: choose one of {', '.join(GPUS)}")
  if cfg.num_heads % sizes["tp"] or cfg.kv_heads % sizes["tp"]:
    raise ValueError(f"tp={sizes['tp']} does not divide the {cfg.num_heads} heads and {cfg.kv_heads}"
                     " key/value heads; choose a tp that divides both")
  global_batch = global_batch or sizes["rp"] * sizes["fs"] * sizes["ep"] * max(sizes["pp"], 1)
  step = plan_model.step_shape(cfg, sizes, global_batch, micro)
  params = plan_model.leaves(cfg, sizes["pp"])
  if rank_fraction is None:
    rank_fraction = default_rank_fraction(max(min(p.shape[-2:]) for p in params if p.label == "dion"))
  per_replica = optimizer == "dion"
  collectives = plan_model.model_collectives(cfg, sizes, step, params, per_replica)
  update, state = plan_optimizer.update(params, sizes, optimizer, rank_fraction, fraction, per_replica,
                                        split_q=split_q, megabatch_bytes=megabatch_bytes)
  collectives = merged(collectives + update)
  link_of = axis_links(sizes, per_node, links or {})
  hw = GPUS[gpu]
  tokens = global_batch * cfg.seq_len
  model_flops = cfg.flops_per_token() * tokens / devices
  opt_flops = plan_optimizer.flops(params, sizes, optimizer, rank_fraction, fraction)
  recompute = plan_memory.recompute_flops(cfg, remat) * tokens / devices / (hw.peak_flops * mfu)
  compute = (model_flops + opt_flops) / (hw.peak_flops * mfu) + recompute
  bubble = compute * (sizes["pp"] - 1) / step.accum if sizes["pp"] > 1 else 0.0
  rows = [dict(c._asdict(), axes=list(c.axes), seconds=collective_time(c, sizes, link_of, network)) for c in collectives]
  comm = sum(r["seconds"] for r in rows)
  if loss_chunk is None:
    loss_chunk = getattr(cfg, "loss_chunk", 0)
  memory = plan_memory.memory(cfg, sizes, step, params, state, remat, offload_optimizer, loss_chunk, optimizer,
                              rank_fraction, split_q, megabatch_bytes)
  # What crosses to the host and back each step: the offloaded residuals, the optimizer state.
  offload = 2 * memory["host_total"] / hw.host_bandwidth
  out = {
      "model": model if isinstance(model, str) else "GPTConfig", "mesh": format_mesh_spec(sizes), "devices": devices, "optimizer": optimizer,
      "rank_fraction": rank_fraction if optimizer == "dion" else None, "split_q": split_q and optimizer == "dion",
      "megabatch_bytes": None if optimizer == "adamw" else megabatch_bytes, "gpu": gpu,
      "global_batch": global_batch, "micro_batch": step.micro, "micro_batches": step.accum, "seq_len": cfg.seq_len,
      "parameters_total": cfg.num_params(), "links": link_of, "collectives": rows,
      "bytes_by_axes": _by(rows, lambda r: ",".join(r["axes"])),
      "bytes_by_purpose": _by(rows, lambda r: r["purpose"]),
      "bytes_total": sum(r["bytes"] for r in rows),
      "time": {"compute": compute, "recompute": recompute, "communication": comm, "bubble": bubble,
               "offload": offload, "step": compute + comm + bubble + offload,
               "step_overlapped": max(compute, comm, offload) + bubble,
               "model_flops": model_flops, "optimizer_flops": opt_flops},
      "memory": memory, "hbm": hw.hbm_bytes, "fits": memory["device_total"] <= hw.hbm_bytes,
      "bound": "communication" if comm > compute else "compute",
  }
  out["caveats"] = caveats(sizes)
  if grpo is not None:
    _add_update_fields(memory, cfg, sizes, step)
    _add_rollout(out, cfg, sizes, params, grpo, hw, mfu)
  if compare:
    out["versus"] = {o: _summary(plan(model, sizes, o, rank_fraction, fraction, global_batch, micro, seq_len, gpu,
                                      per_node, links, mfu, dtype, compare=False, network=network, remat=remat,
                                      offload_optimizer=offload_optimizer, loss_chunk=loss_chunk, grpo=grpo,
                                      split_q=split_q, megabatch_bytes=megabatch_bytes))
                     for o in ("adamw", "muon") if o != optimizer}
  return out


def plan_run(cfg: Config, model_cfg: models.GPTConfig, mesh: str | dict, grpo: plan_grpo.GRPO | None = None,
             **choices: Any) -> dict[str, Any]:
  """The plan of the trainer's run ``cfg`` of ``model_cfg`` (its dtype, recompute policy and
  loss chunk) on ``mesh``, as compiled (``compare=False``); with ``grpo``, GRPO's update of
  that shape. ``choices`` (``remat``, ``offload_optimizer``, ``split_q``, ``megabatch_bytes``) stand in
  for the run's own."""
  return plan(model_cfg, mesh, cfg.optimizer, cfg.dion_rank_fraction, global_batch=cfg.global_batch_size,
              micro=cfg.micro_batch_size, dtype=model_cfg.dtype, compare=False, loss_chunk=model_cfg.loss_chunk,
              grpo=grpo, **{"remat": model_cfg.remat, "offload_optimizer": cfg.offload_optimizer,
                            "split_q": cfg.dion_split_q, "megabatch_bytes": cfg.megabatch_bytes, **choices})


def _add_update_fields(memory: dict, cfg: models.GPTConfig, sizes: dict[str, int], step: plan_model.Step) -> None:
  """What GRPO's update holds beside train.gpt's step (``train.run.plan.grpo``'s
  ``UPDATE_FIELDS``, ``OBJECTIVE_TERMS``): its batch's per-token fields and its objective's
  per-token float32 terms."""
  dp = sizes["rp"] * sizes["fs"] * sizes["ep"]
  rows, tokens = step.global_batch // dp * cfg.seq_len, step.micro * cfg.seq_len // sizes["cp"]
  memory["device"]["grpo_update"] = 4 * (plan_grpo.UPDATE_FIELDS * rows + plan_grpo.OBJECTIVE_TERMS * tokens)
  memory["device_total"] += memory["device"]["grpo_update"]


def _add_rollout(out: dict, cfg: models.GPTConfig, sizes: dict[str, int], params, grpo: plan_grpo.GRPO, hw: GPU,
                 mfu: float) -> None:
  """GRPO's part of a plan: the reference policy (beta > 0) held beside the update, and the
  rollout's memory and time (``train.run.plan.grpo``); the step fits when both phases do."""
  memory = out["memory"]
  if grpo.beta > 0:
    memory["device"]["reference"] = memory["device"]["parameters"]
    memory["device_total"] += memory["device"]["reference"]
  resident = sum(memory["device"].get(k, 0) for k in ("parameters", "optimizer_state", "reference"))
  rollout = plan_grpo.rollout(cfg, sizes, params, grpo, resident, hw.peak_flops, mfu, hw.hbm_bandwidth)
  out["grpo"] = dict(grpo._asdict(), rollout=rollout)
  out["fits"] = memory["device_total"] <= hw.hbm_bytes and rollout["device_total"] <= hw.hbm_bytes
  t = out["time"]
  t["rollout"] = rollout["seconds"]
  t["step"] += rollout["seconds"]
  t["step_overlapped"] += rollout["seconds"]


def caveats(sizes: dict[str, int]) -> list[str]:
  """Where the plan is not the compiler's (tests/test_train_plan.py and
  tests/test_train_run_comm.py check the rest)."""
  out = []
  if sizes["cp"] > 1 and sizes["pp"] > 1:
    out.append("cp beside pp is planned as designed; compiled on CPU, the tables' gathers, their gradients and"
               " the pipeline's sends group differently over cp and pp (tiny, cp=2,tp=2,pp=2: tp exact)")
  return out


def _by(rows, key) -> dict[str, int]:
  out: dict[str, int] = {}
  for r in rows:
    out[key(r)] = out.get(key(r), 0) + r["bytes"]
  return out


def _summary(p: dict) -> dict:
  return {"bytes_total": p["bytes_total"], "step_seconds": p["time"]["step"],
          "optimizer_state": p["memory"]["device"]["optimizer_state"] + p["memory"]["host"]["optimizer_state"],
          "fits": p["fits"]}


def meshes(devices: int, cfg, experts: bool) -> list[dict[str, int]]:
  """Every (rp, fs, ep, tp, pp) of ``devices`` with tp ≤ 8 dividing the heads, pp dividing
  the layers (cp left at 1: a sweep of long contexts is a separate question)."""
  divisors = [d for d in range(1, devices + 1) if devices % d == 0]
  out = []
  for tp, pp, ep in itertools.product(divisors, divisors, divisors if experts else [1]):
    if tp > 8 or cfg.num_heads % tp or cfg.kv_heads % tp or cfg.num_layers % pp or devices % (tp * pp * ep):
      continue
    if experts and cfg.num_experts % ep:
      continue
    rest = devices // (tp * pp * ep)
    for fs in (d for d in divisors if rest % d == 0):
      out.append({"rp": rest // fs, "fs": fs, "ep": ep, "cp": 1, "tp": tp, "pp": pp})
  return out


def remat_policies() -> tuple[str, ...]:
  """The trainer's named recompute policies (``models.remat.POLICIES``)."""
  return tuple(remat.POLICIES)


# The chunks --sweep and the preflight's advice try (``--megabatch-mib 1``): one parameter at a time
# for a model whose matrices pass 1 MiB a device, the update's least memory.
MEGABATCH_MIB = 1


def sweep(model: str, devices: int, top: int = 10, policies: Sequence[str] | None = None,
          offloads: Sequence[bool] = (False, True), splits: Sequence[bool] | None = None,
          megabatches: Sequence[int | None] | None = None, **kwargs) -> list[dict]:
  """For each mesh of ``devices``, the fastest (non-overlapped step) recompute policy,
  optimizer offload, for Dion on tp > 1 Q's split over tp (``splits``; default both) and
  the update's chunks (``megabatches``: ``megabatch_bytes`` values; for Dion None and
  :data:`MEGABATCH_MIB`, for the others None: a Muon chunk smaller than its device group is
  padded to it, which the plan does not count) that fit; the meshes that have one, fastest
  first."""
  cfg = plan_model.load_config(model, kwargs.get("seq_len"), kwargs.get("dtype", "bfloat16"))
  optimizer = kwargs.get("optimizer", TRAINER.optimizer)
  if splits is None:
    splits = (False, True) if optimizer == "dion" else (False,)
  if megabatches is None:
    megabatches = (None, MEGABATCH_MIB * 2**20) if optimizer == "dion" else (None,)
  ok = []
  for sizes in meshes(devices, cfg, cfg.num_experts > 0):
    best = None
    # Q splits over tp only (the GPT's row axis): on tp=1 a split plan is the unsplit one.
    choices = [(policy, offload, split, chunk) for policy, offload, split, chunk in
               itertools.product(policies or remat_policies(), offloads, splits, megabatches)
               if sizes["tp"] > 1 or not split]
    for policy, offload, split, chunk in choices:
      try:
        p = plan(model, sizes, compare=False, remat=policy, offload_optimizer=offload, split_q=split,
                 megabatch_bytes=chunk, **kwargs)
      except ValueError:
        break  # the batch or a dimension does not split on this mesh
      if p["fits"] and (best is None or p["time"]["step"] < best["time"]["step"]):
        best = p
    if best is not None:
      ok.append(best)
  return sorted(ok, key=lambda p: p["time"]["step"])[:top]


def format_sweep(found: list[dict]) -> str:
  """The sweep as a Markdown table, each mesh's caveats in its last column."""
  lines = ["| mesh | --remat | --offload-optimizer | --dion-split-q | --megabatch-mib | step ms | compute (recompute)"
           " | communication | bubble | offload | device memory | host memory | communication/device/step | bound"
           " | caveats |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  yes = lambda flag: "yes" if flag else "no"  # noqa: E731
  for p in found:
    t, m = p["time"], p["memory"]
    chunk = p["megabatch_bytes"]
    lines.append(f"| {p['mesh']} | {m['policy']} | {yes(m['offload_optimizer'])} | {yes(p['split_q'])}"
                 f" | {'off' if chunk is None else f'{chunk / 2**20:g}'} | {t['step'] * 1e3:.1f}"
                 f" | {t['compute'] * 1e3:.1f} ({t['recompute'] * 1e3:.1f}) | {t['communication'] * 1e3:.1f}"
                 f" | {t['bubble'] * 1e3:.1f} | {t['offload'] * 1e3:.1f} | {size(m['device_total'])}"
                 f" | {size(m['host_total'])} | {size(p['bytes_total'])} | {p['bound']}"
                 f" | {'; '.join(p['caveats']) or 'none'} |")
  return "\n".join(lines)


def size(n: float) -> str:
  """Bytes in the unit that shows them: GiB, MiB or KiB."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= scale:
      return f"{n / scale:,.2f} {unit}"
  return f"{n / 2**10:,.1f} KiB"


def format_memory(m: dict, hbm: float) -> list[str]:
  """The memory lines of a plan: device and host parts per device."""
  def parts(where):
    return ", ".join(f"{k.replace('_', ' ')} {size(v)}" for k, v in m[where].items() if v)

  flags = f"--remat {m['policy']}" + (" --offload-optimizer" if m["offload_optimizer"] else "")
  flags += f" --loss-chunk {m['loss_chunk']}" if m["loss_chunk"] else ""
  host = f"; host {size(m['host_total'])} ({parts('host')})" if m["host_total"] else "; nothing on the host"
  return [f"memory ({flags}): device {size(m['device_total'])} of {size(hbm)} ({parts('device')}){host}",
          f"residuals kept per layer: {', '.join(m['residuals_per_layer'])}"]


def format_rollout(p: dict) -> list[str]:
  """GRPO's rollout line, if the plan has one."""
  if "grpo" not in p:
    return []
  g, r = p["grpo"], p["grpo"]["rollout"]
  parts = ", ".join(f"{k.replace('_', ' ')} {size(v)}" for k, v in r["device"].items() if v)
  return [f"GRPO: {g['prompts']} prompts x {g['group']} completions of {g['prompt']} + {g['completion']} tokens,"
          f" beta {g['beta']:g}; rollout {r['seconds'] * 1e3:,.0f} ms (prefill {r['prefill_seconds'] * 1e3:,.0f},"
          f" decode {r['decode_seconds'] * 1e3:,.0f}), device {size(r['device_total'])} ({parts})"]


def format_plan(p: dict) -> str:
  t, m = p["time"], p["memory"]
  lines = [f"{p['model']} ({p['parameters_total'] / 1e9:.2f}B) on {p['mesh']} ({p['devices']} x {p['gpu']}),"
           f" {p['optimizer']}" + (f" rank {p['rank_fraction']:g}" if p["rank_fraction"] else "")
           + (", Q split over tp" if p["split_q"] else "")
           + (f", update chunks of {p['megabatch_bytes'] / 2**20:g} MiB" if p["megabatch_bytes"] else "") + f"; batch {p['global_batch']} x {p['seq_len']}, {p['micro_batches']} micro-batches of {p['micro_batch']}",
           "", "| purpose | op | axes | link | MiB/device/step | ms |", "| --- | --- | --- | --- | --- | --- |"]
  for r in sorted(p["collectives"], key=lambda r: -r["bytes"]):
    link = "/".join(sorted({p["links"][a] for a in r["axes"]}))
    lines.append(f"| {r['purpose']} | {r['op']} | {','.join(r['axes'])} | {link} | {r['bytes'] / 2**20:,.1f}"
                 f" | {r['seconds'] * 1e3:.2f} |")
  lines += ["", f"communication {size(p['bytes_total'])}/device/step: "
            + ", ".join(f"{k} {size(v)}" for k, v in p["bytes_by_purpose"].items()),
            f"time: compute {t['compute'] * 1e3:.1f} ms, communication {t['communication'] * 1e3:.1f} ms,"
            f" bubble {t['bubble'] * 1e3:.1f} ms; step {t['step'] * 1e3:.1f} ms"
            f" ({t['step_overlapped'] * 1e3:.1f} ms if communication overlaps compute)",
            *format_memory(m, p["hbm"]), *format_rollout(p),
            f"verdict: {'fits' if p['fits'] else 'does not fit'}, {p['bound']}-bound"] + [f"caveat: {c}" for c in p["caveats"]]
  for o, v in p.get("versus", {}).items():
    lines.append(f"  vs {o}: {size(v['bytes_total'])}/device/step, step {v['step_seconds'] * 1e3:.1f} ms,"
                 f" optimizer state {size(v['optimizer_state'])}{'' if v['fits'] else ', does not fit'}")
  return "\n".join(lines)
