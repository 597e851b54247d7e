"""The wire format between clients and infinityd: schemas, codec, protocol version.

`wire` owns every message's schema and its msgpack encoding; `dtypes` the
element types; `paths` the runtime folder's layout; `fdpass` the fd-passing
mechanics of the data plane. Neither side imports the other: both import this.
"""

from infinity.protocol.wire import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
