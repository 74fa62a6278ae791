"""Pallas GPU kernels, one module per kernel family, each with an XLA path beside it.

- ``rcqr`` (``rcqr_sketch``, ``rcqr_solve``): the passes of randomized Cholesky QR
  (Dion's orthonormalization); the XLA composition is ``dion_jax.orthogonalize``'s.
- ``newton_schulz``: the symmetric products of the polar iterations of Muon, NorMuon
  and Dion2 (``dion_jax.polar``), with ``xla_symmetric_products`` beside it.
- ``pallas_common``: backend, precision, batching and mesh typing they share.
"""
