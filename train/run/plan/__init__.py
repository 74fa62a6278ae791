"""The planner: a training step's bytes, time and memory on a mesh beyond this machine, from
the model's shapes and the trainer's flags (``python -m train.plan`` prints it; the preflight
asks it what would fit)."""
