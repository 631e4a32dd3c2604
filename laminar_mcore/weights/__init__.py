"""Weight formats shared by the trainer, the relays and the engines (where they meet)."""

from .bucket import (ShmBucket, TensorMeta, decode_handle, encode_handle, layout, open_handle,
                     read_bucket, write_bucket)

__all__ = ["ShmBucket", "TensorMeta", "decode_handle", "encode_handle", "layout", "open_handle",
           "read_bucket", "write_bucket"]
