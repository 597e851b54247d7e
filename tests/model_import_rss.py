"""An importer run in its own process for the memory test: imports a small model (the warm-up:
first-use allocations, the same for any model), then resets the kernel's high-water mark of its
resident memory (VmHWM) and imports the model under test, with the quantized forms given
(comma-separated, or none); prints, as JSON, its resident size before that import and the peak
during it.

    python model_import_rss.py SETTINGS_FILE RUNTIME_DIR WARM_UP_FOLDER MODEL_FOLDER [FORMS]
"""

from __future__ import annotations

import json
import sys

from offloaded_trainer_rss import resident_bytes  # this folder is the script's: on sys.path


def main(settings_file: str, runtime_dir: str, warm_up: str, folder: str, forms: str = "") -> None:
    import infinity
    from infinity.config import load_config
    from infinity.torch.model_store import import_model

    config = load_config(settings_file, env={}, overrides={"daemon.runtime_dir": runtime_dir})
    client = infinity.connect(config=config, name="rss-import")
    try:
        quantize = [form for form in forms.split(",") if form]
        import_model(client, warm_up, namespace="warm-up", progress=False, quantize=quantize)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
        before = resident_bytes("VmRSS")
        report = import_model(client, folder, namespace="measured", progress=False,
                              quantize=quantize)
        print(json.dumps({"rss_before_bytes": before, "peak_rss_bytes": resident_bytes("VmHWM"),
                          "shared_rss_bytes": resident_bytes("RssShmem"),
                          "tensor_bytes": report.tensor_bytes, "quantized": report.quantized}))
    finally:
        client.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
