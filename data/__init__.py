"""Token data for dion-jax: sources, formats and the Grain loader.

    source = data.load_source("stdlib")        # or a FineWeb glob, Megatron prefix, blend
    it = data.make_loader(source, seq_len=256, global_batch_size=8, seed=0)
    batch = next(it)                           # {"inputs", "targets"}: int32 [8, 256]
    state = it.get_state()                     # JSON-serializable; it.set_state(state)

To checkpoint the iterator, save ``it.get_state()`` as JSON beside the arrays and call
``it.set_state`` on restore, as ``train/store/checkpoint.py`` does: the state counts global
steps, the same on every process, so one copy restores on any number of processes
(Grain's own checkpoint handler keys its files by the process count).
"""
from data.errors import DataError, DataFileNotFoundError
from data.loader import make_dataset, make_loader, ordered_rows, process_batch_shard
from data.sft import SFTSource
from data.sources import Blend, TokenSource, load_source
from data.token_ids import max_token_id
from data.tokenizer import EOD, VOCAB_SIZE, decode, encode, padded_vocab_size

__all__ = [
    "Blend", "DataError", "DataFileNotFoundError", "EOD", "SFTSource", "TokenSource", "VOCAB_SIZE",
    "decode", "encode", "load_source", "max_token_id", "make_dataset", "make_loader", "ordered_rows",
    "padded_vocab_size", "process_batch_shard",
]
