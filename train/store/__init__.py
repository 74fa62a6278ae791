"""What a run writes and reads back: its directory and lock, checkpoints, the metrics log
and trackers, profiles, and Hugging Face files and the Hub. Below ``train.run``; nothing
here knows a training step."""
