"""Bytes on disk, format-agnostic: reads and writes around the page cache (``O_DIRECT``), byte
ranges copied in the kernel, and the page-cache footprint of large writes. Shared by checkpoints
and porting.

May import: ``jaxmoe.errors``.
"""
