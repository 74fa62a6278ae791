"""A Flax NNX GPT with tensor, sequence, fully-sharded, pipeline, context and expert parallelism."""
from models import fp8, moe, qk_clip
from models.config import PRESETS, GPTConfig, preset
from models.gpt import GPT, abstract, init
from models.lm_loss import LossAux, loss, token_logps
from models.sharding import BATCH_AXES, Parallelism, param_specs, to_layers, to_stages

__all__ = ["BATCH_AXES", "GPT", "abstract", "GPTConfig", "LossAux", "PRESETS", "Parallelism", "init", "loss", "token_logps",
           "moe", "param_specs", "preset", "qk_clip", "to_layers", "to_stages"]
