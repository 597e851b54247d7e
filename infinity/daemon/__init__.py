"""infinityd internals: lifecycle, server loop, catalog, CPU tier. Clients never import this."""
