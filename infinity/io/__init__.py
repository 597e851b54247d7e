"""Typed Python API over the native async I/O engine: futures, aligned buffers."""
