"""train/run/model_source.py: the flags that set how the model computes reach its GPTConfig."""
from train.run import config as config_lib
from train.run import model_source


def test_compute_flags_reach_the_model():
  source = model_source.resolve(None, "tiny")
  cfg = source.model_config(config_lib.parse(["--loss-chunk", "96"]), 257)
  assert (cfg.loss_chunk, cfg.vocab_size) == (96, 257)
  assert source.model_config(config_lib.parse([]), 257).loss_chunk == config_lib.Config.loss_chunk
