"""Kernel families, each a Pallas GPU module beside its XLA composition, and the
vendor-library factorizations. Importing this package imports none of them.

- ``backend``: picks Pallas or XLA per call.
- ``rcqr`` (``rcqr_sketch``, ``rcqr_solve``) and ``rcqr_xla``: the three passes of
  randomized Cholesky QR over P (``dion_jax.linalg.qr``).
- ``newton_schulz`` and ``newton_schulz_xla``: the symmetric products of the polar
  iterations (``dion_jax.linalg.polar``).
- ``cholesky`` and ``cholesky_xla``: the Cholesky factor and its inverse of a batch of small
  blocks, one launch for the whole batch (``dion_jax.linalg.cholesky``'s diagonal blocks).
- ``sketch``: the counter-based sketch matrix both RCQR paths generate.
- ``lapack``: small QR, Cholesky and triangular inverses, batched safely per backend.
- ``pallas_common``: tiles, precision and batching the Pallas modules share.
"""
