"""Neutral weight formats shared by the trainer, the relays and the engines (where they meet):
flattened buckets and their ``TensorMeta`` (``bucket``: layout, shared-memory handles, the
``BucketPacker``) and the trainer -> relay publish channel (``transport``). Export from
Megatron shards is the trainer's (``trainer/export.py``); pull transports are the relay's
(``relay/transports``)."""

from .bucket import (ShmBucket, TensorMeta, decode_handle, encode_handle, layout, open_handle,
                     read_bucket, write_bucket)

__all__ = ["ShmBucket", "TensorMeta", "decode_handle", "encode_handle", "layout", "open_handle",
           "read_bucket", "write_bucket"]
