"""Megatron-Core's ``dist_checkpointing.save`` without a process per rank for its results.

Megatron's torch_dist writer (``FileSystemWriterAsync``) hands each rank's write results back
through a module-level queue that it creates, on first use, as ``Manager().Queue()`` in a
*spawn* context: a server process that re-imports the rank's main module (the trainer's whole
import, 2-3 CPU-seconds, per rank, per process that saves). That queue crosses processes only
for ``async_sharded_save``, which laminar does not use: its saves write in the calling
process, which also reads the results back. :func:`save_sharded` gives Megatron an in-process
``queue.Queue`` for a synchronous save (the same ``put``/``get_nowait`` the writer calls) and
leaves an asynchronous one, or a queue Megatron already made, as they are.
"""

from __future__ import annotations

import queue


def use_in_process_results_queue() -> bool:
    """Give Megatron's torch_dist writer an in-process results queue unless it has one; True
    when the queue in place is in-process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return isinstance(filesystem_async._results_queue, queue.Queue)


def save_sharded(sharded_state_dict, checkpoint_dir: str, **kwargs):
    """``megatron.core.dist_checkpointing.save`` (same arguments and result); a synchronous
    save reads its write results from an in-process queue."""
    from megatron.core import dist_checkpointing

    if not kwargs.get("async_sharded_save", False):
        use_in_process_results_queue()
    return dist_checkpointing.save(sharded_state_dict, checkpoint_dir, **kwargs)
