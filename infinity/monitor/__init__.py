"""infinity-top and the telemetry data API; the data API never imports the UI."""
