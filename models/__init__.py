"""A Flax NNX GPT with tensor, sequence, fully-sharded, pipeline and context parallelism."""
from models import qk_clip
from models.config import PRESETS, GPTConfig, preset
from models.gpt import GPT, abstract, init
from models.lm_loss import loss
from models.sharding import Parallelism, param_specs, to_layers, to_stages

__all__ = ["GPT", "abstract", "GPTConfig", "PRESETS", "Parallelism", "init", "loss", "param_specs", "preset",
           "qk_clip", "to_layers", "to_stages"]
