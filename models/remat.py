"""Recompute policies by name: what each layer keeps for its backward pass, and where.

Every layer runs under ``jax.checkpoint`` (``models.gpt.apply_layers``); its policy decides
which of the layer's tensors the forward pass keeps and which the backward pass recomputes.
The model tags those tensors with ``jax.ad_checkpoint.checkpoint_name`` at the names of
:data:`NAMES` (shapes per layer, B sequences of T tokens, N query and K key/value heads of
width H, F the MLP's width)::

    layer_input     [B, T, D]      the layer's input (float32 residual stream)
    query_proj      [B, T, N, H]   x W_q, before QK-norm and the rotary embedding
    key_proj        [B, T, K, H]   x W_k, likewise
    value_proj      [B, T, K, H]   x W_v
    attention_out   [B, T, N·H]    softmax(q kᵀ) v, the out projection's input
    out_proj        [B, T, D]      its product with W_o
    mlp_gate        [B, T, F]      x W_gate (SwiGLU only)
    mlp_up          [B, T, F]      x W_up
    mlp_down        [B, T, D]      act(·) W_down (never kept: below)
    expert_gate     [A, F]         the experts' products on their A = B·T·k routed rows
    expert_up       [A, F]
    expert_down     [A, D]

The policies (:data:`POLICIES`), named as Megatron-LM's and MaxText's: ``none`` keeps every
matrix product (``dots_saveable``, the attention's scores [B, N, T, T] among them, which
carry no name), ``full`` only the layer's input, the others the named tensors of
:func:`placements`, on the device or in pinned host memory (``"host"``: JAX's
``save_and_offload_only_these_names``, moved out after the forward pass and back for the
backward one). ``custom:NAME=PLACE,...`` names its own (PLACE ``device`` or ``host``).

``mlp_down`` is tagged but never kept: the backward pass never reads it (it only enters the
residual sum), so JAX drops it from the residuals whatever the policy says, and
:func:`placements` leaves it out. The layer's input is kept under every policy: it is the checkpointed function's argument,
which the backward pass starts from (on the device unless a custom policy puts
``layer_input`` on the host). Every policy computes the same function, so the same loss
and gradients as ``none`` up to the order of float32 roundings; they differ in memory and
in the forward work redone.

The experts' tags take effect on one device: on a mesh, the mixture of experts' dispatch
runs under a ``custom_vjp`` (``models/moe.py``) that keeps only its input and weights and
re-runs the experts in its backward pass under every policy.

XLA:CPU (jax 0.10.2) lowers a transfer to host memory inside a computation to nothing
(``jax._src.dispatch``: only TPU and GPU lower ``device_put`` to a memory kind), so on CPU
the offloaded policies keep their tensors on the device, as the device-placed policy of
the same names does; a GPU or TPU program holds them in pinned host memory.
"""
from __future__ import annotations

import jax

NAMES = ("layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj",
         "mlp_gate", "mlp_up", "mlp_down", "expert_gate", "expert_up", "expert_down")
PLACES = ("device", "host")
CUSTOM = "custom:"

_QKV = ("query_proj", "key_proj", "value_proj")
_MLP = ("mlp_gate", "mlp_up", "expert_gate", "expert_up", "expert_down")
# Every named matrix product but the experts' (grouped matmuls, which dots_saveable leaves).
_DOTS = (*_QKV, "attention_out", "out_proj", "mlp_gate", "mlp_up")
# Tensors the backward pass never reads: no policy keeps them.
_UNREAD = ("mlp_down",)


def _kept(device: tuple[str, ...] = (), host: tuple[str, ...] = ()) -> dict[str, str]:
  return {"layer_input": "device", **dict.fromkeys(device, "device"), **dict.fromkeys(host, "host")}


# Name -> what it keeps (one line of --help each: ``train.run.flags.REMAT_POLICIES``).
POLICIES: dict[str, dict[str, str]] = {
    "none": _kept(_DOTS),
    "full": _kept(),
    "selective": _kept((*_QKV, "attention_out", "out_proj", *_MLP)),
    "save_qkv_proj": _kept(_QKV),
    "save_dot_except_mlp": _kept((*_QKV, "out_proj")),
    "save_out_proj": _kept(("out_proj",)),
    "qkv_proj_offloaded": _kept(host=_QKV),
    "minimal_offloaded": _kept(host=(*_QKV, "out_proj", *_MLP)),
}


def _bad(name: str, detail: str) -> ValueError:
  return ValueError(f"recompute policy (--remat) {name!r}: {detail}; choose one of {', '.join(POLICIES)}, or"
                    f" {CUSTOM}NAME=PLACE,... with NAME in {', '.join(NAMES)} and PLACE device or host")


def placements(policy: str) -> dict[str, str]:
  """What the policy named ``policy`` keeps for the backward pass and where: tag name ->
  ``"device"`` or ``"host"``; names absent are recomputed (``mlp_down`` is never kept).
  ``none`` keeps besides these the attention's score products, which carry no name.
  Raises a one-line ValueError naming the policies for an unknown name."""
  if policy in POLICIES:
    return dict(POLICIES[policy])
  if not isinstance(policy, str) or not policy.startswith(CUSTOM):
    raise _bad(policy, "unknown")
  kept = {"layer_input": "device"}
  for item in policy[len(CUSTOM):].split(","):
    name, eq, place = (part.strip() for part in item.partition("="))
    if name not in NAMES:
      raise _bad(policy, f"{name!r} is no tensor NAME" if name else "a NAME=PLACE is missing")
    if not eq or place not in PLACES:
      raise _bad(policy, f"{item.strip()!r} has no PLACE device or host")
    if name not in _UNREAD:
      kept[name] = place
  return kept


def policy(name: str):
  """The ``jax.checkpoint`` policy of the recompute policy ``name``."""
  kept = placements(name)
  if name == "none":
    return jax.checkpoint_policies.dots_saveable
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[n for n, place in kept.items() if place == "device"],
      names_which_can_be_offloaded=[n for n, place in kept.items() if place == "host"],
      offload_src="device", offload_dst="pinned_host")
