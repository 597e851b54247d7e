"""The wire format between clients and infinityd: schemas, codec, protocol version."""
