"""``python -m train.grpo``: GRPO fine-tuning with verifiable rewards on the trainer's step."""
