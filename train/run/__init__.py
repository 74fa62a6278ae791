"""What one training run needs: its configuration and flags, set-up and loop, the jitted
step and the optimizer, evaluation, the faults of many processes (peers, signals, spikes)
and what the step sends. Below the commands; above ``train.store``."""
