"""A short Dion example: a small byte-level language model on the embedded corpus.

    python -m train.demo [--steps 200] [--rank-fraction 0.25]

The model predicts each byte from the previous ``context`` bytes with a
two-hidden-layer MLP (embedding -> concat -> Dense -> ReLU² -> Dense -> ReLU² ->
head). Its two hidden kernels train with Dion; the embedding, the biases and the
head with AdamW, routed by ``dion_jax.dion``'s default labels. It prints the train
loss and, at the end, the validation loss in nats per byte (ln 256 ≈ 5.55 at
random). It stands in until the GPT trainer (``python -m train.gpt``) lands.
"""

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import data
import dion_jax


class ByteMLP(nn.Module):
  vocab: int
  context: int = 8
  d_embed: int = 32
  d_hidden: int = 256

  @nn.compact
  def __call__(self, tokens_BxL):
    x_BxLxE = nn.Embed(self.vocab, self.d_embed, name="embed")(tokens_BxL)
    windows = [jnp.pad(x_BxLxE, ((0, 0), (k, 0), (0, 0)))[:, : tokens_BxL.shape[1]] for k in range(self.context)]
    h_BxLxH = jnp.concatenate(windows, axis=-1)
    for i in range(2):
      h_BxLxH = jnp.square(nn.relu(nn.Dense(self.d_hidden, name=f"hidden_{i}")(h_BxLxH)))
    return nn.Dense(self.vocab, name="lm_head")(h_BxLxH)


def loss_fn(params, model, batch):
  logits_BxLxV = model.apply({"params": params}, batch["inputs"])
  return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"]).mean()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
  parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
  parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (default 128)")
  parser.add_argument("--learning-rate", type=float, default=0.02, help="Dion's base learning rate (default 0.02)")
  parser.add_argument("--rank-fraction", type=float, default=0.25, help="Dion's rank fraction (default 0.25)")
  parser.add_argument("--seed", type=int, default=0, help="seed of init and data order (default 0)")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch_size < 1 or args.seq_len < 1:
    parser.error("--steps, --batch-size and --seq-len must be positive")
  try:
    tx = dion_jax.dion(args.learning_rate, rank_fraction=args.rank_fraction, scalar_learning_rate=3e-3)
    train = data.make_loader(
        data.load_source("stdlib:train"), seq_len=args.seq_len, global_batch_size=args.batch_size, seed=args.seed
    )
    val = data.make_loader(
        data.load_source("stdlib:val"), seq_len=args.seq_len, global_batch_size=args.batch_size, seed=0, num_epochs=1
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  model = ByteMLP(vocab=data.padded_vocab_size())
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, model, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  eval_loss = jax.jit(lambda params, batch: loss_fn(params, model, batch))
  start = time.perf_counter()
  for step in range(1, args.steps + 1):
    params, opt_state, loss = train_step(params, opt_state, next(train))
    if step == 1 or step % 25 == 0 or step == args.steps:
      print(f"step {step:5d}  train loss {float(loss):.3f}  ({time.perf_counter() - start:.1f} s)", flush=True)
  losses = [float(eval_loss(params, batch)) for _, batch in zip(range(20), val)]
  print(f"validation loss {sum(losses) / len(losses):.3f} nats/byte over {len(losses)} batches")
  return 0


if __name__ == "__main__":
  sys.exit(main())
