"""The run's data, as `dataset.streaming` says: the token store's loaders (data/prepare.py: built once,
reused by later attempts; methods/dpo_pairs.py's pairs for format preference) or a stream tokenized
while training (streaming.py, built on data/encoding.py's encoder and data/batching.py's batches; methods/dpo_stream.py's pairs for format
preference). Above both, so neither imports the other."""

from __future__ import annotations

import time

from llamaft.api.spec import DatasetFormat, DatasetSpec
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data.batching import Data, loaders
from llamaft_trainer.data.global_order import attach
from llamaft_trainer.data.prepare import prepared_store, store_root
from llamaft_trainer.data.streaming import streaming_data
from llamaft_trainer.methods.dpo_pairs import PairEncoder, pair_loaders
from llamaft_trainer.methods.dpo_stream import streaming_pairs
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime


def build_data(
    spec: DatasetSpec, tok: PreTrainedTokenizerBase, batch_size: int, seed: int, rt: Runtime, checkpoint_directory: str,
    global_batch: int | None = None,
) -> Data:
    """The run's data: from the token store (built once, reused by later attempts), or a stream.
    `global_batch` (training.globalBatchSize): the steps come from one order of the training items
    that does not depend on the world size (global_order.py)."""
    pad_id = int(tok.pad_token_id)
    root, shared = store_root(checkpoint_directory)
    pairs = spec.format is DatasetFormat.PREFERENCE
    if spec.streaming and global_batch is not None:
        raise ConfigError(
            "spec.training.globalBatchSize takes each step's items from one global order, which needs the token "
            "store: set dataset.streaming: false or remove training.globalBatchSize"
        )
    if spec.streaming:
        index_root = root if shared or rt.world_size == 1 else None
        if pairs:  # pairs tokenized while training, never packed (methods/dpo_stream.py)
            return streaming_pairs(spec, tok, batch_size, seed, rt, index_root)
        return streaming_data(spec, tok, batch_size, seed, rt, index_root)
    started = time.perf_counter()
    if pairs:
        store = prepared_store(spec, tok, seed, rt, root, shared, PairEncoder)
        data: Data = pair_loaders(store, spec, pad_id, batch_size, seed, rt.rank, rt.world_size,
                                  global_order=global_batch is not None)
    else:
        store = prepared_store(spec, tok, seed, rt, root, shared)
        data = loaders(store, spec, pad_id, batch_size, seed, rt.rank, rt.world_size, global_order=global_batch is not None)
    if global_batch is not None:
        what = "pairs" if pairs else "packed blocks" if spec.packing else "sequences"
        attach(data, global_batch, rt.rank, rt.world_size, seed, what)
    data.info["data_seconds"] = round(time.perf_counter() - started, 3)
    return data
