"""The `infinity` command: doctor, tune, bench, verify, demo."""
