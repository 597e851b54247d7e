"""The client side: transport to infinityd and the Client API."""
