"""``python -m train.gpu``: the GPU evidence (kernels, optimizers, MoE, the trainer, a profile)."""
