"""``python -m train.plan``: a training step's bytes, time and memory on a mesh beyond this machine."""
