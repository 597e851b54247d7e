"""The one configuration loader: file, environment, flags; unknown names are errors."""

import re
from pathlib import Path

import pytest

from infinity.config import TABLES, is_setting_variable, load_config, settings_as_toml
from infinity.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "infinity.toml"
    path.write_text(text)
    return path


def test_defaults_apply_without_a_file() -> None:
    config = load_config(env={})
    assert config.io.queue_depth == 16
    assert config.source == "defaults"


def test_file_environment_and_flags_override_in_that_order(tmp_path: Path) -> None:
    path = write(tmp_path, "[io]\nqueue_depth = 8\nblock_size_bytes = 262144\n")
    env = {"INFINITY_IO_QUEUE_DEPTH": "16"}
    config = load_config(path, env=env, overrides=["io.block_size_bytes=524288"])
    assert config.io.queue_depth == 16
    assert config.io.block_size_bytes == 524288


def test_config_path_comes_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[nvme]\ndirs = [\"/a\", \"/b\"]\n")
    assert load_config(env={"INFINITY_CONFIG": str(path)}).nvme.dirs == ("/a", "/b")


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[io]\nqueue_dept = 8\n")
    with pytest.raises(ConfigError, match="unknown setting io.queue_dept"):
        load_config(path, env={})


def test_unknown_table_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown table \[gpu\]"):
        load_config(write(tmp_path, "[gpu]\nx = 1\n"), env={})


def test_unknown_environment_variable_is_an_error() -> None:
    with pytest.raises(ConfigError, match="INFINITY_IO_DEPTH"):
        load_config(env={"INFINITY_IO_DEPTH": "3"})


def test_wrong_type_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="io.queue_depth must be an integer"):
        load_config(write(tmp_path, "[io]\nqueue_depth = \"deep\"\n"), env={})


def test_out_of_range_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="block_size_bytes must be a power of two"):
        load_config(env={}, overrides=["io.block_size_bytes=3000"])


def test_malformed_flag_is_an_error() -> None:
    with pytest.raises(ConfigError, match="table.key=value"):
        load_config(env={}, overrides=["queue_depth"])


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_namespace_quotas_read_the_same_from_a_file_the_environment_and_flags(tmp_path: Path) -> None:
    from infinity.client.launch import settings_as_flags

    path = write(tmp_path, '[scheduler]\nnamespace_quota_bytes = { weights = 4096, optim = 8192 }\n')
    from_file = load_config(path, env={})
    from_env = load_config(env={"INFINITY_SCHEDULER_NAMESPACE_QUOTA_BYTES": "optim=8192,weights=0x1000"})
    assert from_file.scheduler.namespace_quota_bytes == (("optim", 8192), ("weights", 4096))
    assert from_env.scheduler == from_file.scheduler
    # What connect(start=True) passes to the daemon it starts reads back the same.
    flags = [f for f in settings_as_flags(from_file) if f != "--set"]
    assert load_config(env={}, overrides=flags).scheduler == from_file.scheduler
    assert from_file.scheduler.quota_bytes("weights") == 4096


@pytest.mark.parametrize("text", ["weights", "=4096", "a,b=4096", "weights=lots", "weights=-1"])
def test_a_malformed_namespace_quota_is_an_error(text: str) -> None:
    with pytest.raises(ConfigError, match="namespace_quota_bytes"):
        load_config(env={}, overrides=[f"scheduler.namespace_quota_bytes={text}"])


def test_staged_reads_and_writes_take_auto_on_or_off_only() -> None:
    config = load_config(env={})
    assert (config.nvme.staged_reads, config.nvme.staged_writes) == ("off", "off")
    assert load_config(env={"INFINITY_NVME_STAGED_READS": "off"}).nvme.staged_reads == "off"
    for key in ("staged_reads", "staged_writes"):
        with pytest.raises(ConfigError, match=f"nvme.{key} must be auto, on or off"):
            load_config(env={}, overrides=[f"nvme.{key}=yes"])


@pytest.mark.parametrize("setting, hugepages, expected", [
    ("on", True, True), ("off", False, False), ("auto", False, True)])
def test_a_staging_setting_decides_whether_its_direction_is_staged(
        setting: str, hugepages: bool, expected: bool) -> None:
    from infinity.daemon.tiers import staged_wanted

    config = load_config(env={}, overrides=[f"cpu.hugepages={str(hugepages).lower()}"])
    assert staged_wanted(config, setting) is expected


def test_staging_auto_follows_whether_shared_memory_gets_huge_pages() -> None:
    from infinity.daemon.arena import shmem_hugepages_allowed
    from infinity.daemon.tiers import staged_wanted
    from infinity.io import probe_shared_memory_collapse

    config = load_config(env={}, overrides=["cpu.hugepages=true"])
    huge = shmem_hugepages_allowed() or probe_shared_memory_collapse()[0]
    assert staged_wanted(config, "auto") is not huge
    # Segments are collapsed only when prefaulted.
    lazy = load_config(env={}, overrides=["cpu.hugepages=true", "cpu.prefault=false"])
    assert staged_wanted(lazy, "auto") is not shmem_hugepages_allowed()


def test_staging_bytes_must_be_positive() -> None:
    assert load_config(env={}).io.staging_bytes == 4 * 1024 * 1024
    with pytest.raises(ConfigError, match="io.staging_bytes must be between 1 and"):
        load_config(env={}, overrides=["io.staging_bytes=0"])


@pytest.mark.parametrize("name", ["INFINITY_VENV", "INFINITY_BUILD_JOBS", "INFINITY_TEST_DISK_DIR",
                                  "INFINITY_NATIVE_ASAN", "INFINITY_PEERS_DIR",
                                  "INFINITY_PEERS_PYTHON", "INFINITY_PEERS_SKIP_APT"])
def test_the_variables_of_the_scripts_and_the_build_are_not_settings(name: str) -> None:
    assert load_config(env={name: "/some/where"}) == load_config(env={})


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e300"])
def test_a_duration_must_be_finite_and_at_most_a_day(value: str) -> None:
    with pytest.raises(ConfigError, match="daemon.request_timeout_s"):
        load_config(env={}, overrides=[f"daemon.request_timeout_s={value}"])


def test_a_rate_may_exceed_the_seconds_in_a_day() -> None:
    config = load_config(env={}, overrides=["scheduler.initial_read_bandwidth_bytes_per_s=3e9"])
    assert config.scheduler.initial_read_bandwidth_bytes_per_s == 3e9


def test_a_config_path_that_is_a_folder_is_a_config_error_naming_its_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="from --config.*cannot be read"):
        load_config(tmp_path, env={})
    with pytest.raises(ConfigError, match="from INFINITY_CONFIG.*cannot be read"):
        load_config(env={"INFINITY_CONFIG": str(tmp_path)})


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes("[daemon]\nlog_level = \"caf\xe9\"\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path, env={})


def test_settings_written_as_toml_read_back_the_same(tmp_path: Path) -> None:
    config = load_config(env={}, overrides={
        "nvme.dirs": ["/data/a,b", "/mnt/c:d", " spaced "], "cpu.budget_bytes": 3 << 30,
        "scheduler.namespace_quota_bytes": {"weights": 1 << 30, "optim": 2 << 30},
        "daemon.log_level": "debug", "scheduler.lookahead_min_s": 0.25})
    path = tmp_path / "all.toml"
    path.write_text(settings_as_toml(config))
    again = load_config(path, env={})
    for table in TABLES:
        assert getattr(again, table) == getattr(config, table)


def test_a_cpu_budget_that_is_not_whole_2_mib_granules_is_refused() -> None:
    # 17 MiB: a 16.5 MiB tensor fit the budget but not its granules, and never found room.
    with pytest.raises(ConfigError, match="multiple of 2 MiB"):
        load_config(env={}, overrides={"cpu.budget_bytes": 17 << 20, "cpu.segment_bytes": 4 << 20})


def test_every_infinity_variable_the_scripts_read_is_kept_apart_from_the_settings() -> None:
    # Such a variable, set as the README says (INFINITY_TEST_WORKERS=1), reaches every command
    # the tests start, whose config loader would refuse it as an unknown setting.
    root = Path(__file__).resolve().parents[1]
    sources = [root / "setup.py", root / "tests" / "conftest.py", *root.glob("scripts/*.sh"),
               *root.glob(".ci/*"), *root.glob("tools/**/*.py"), *root.glob("tools/**/*.sh")]
    names = {name for path in sources if path.is_file()
             for name in re.findall(r"\bINFINITY_[A-Z][A-Z_]*\b", path.read_text())}
    assert "INFINITY_TEST_WORKERS" in names  # the scan sees the scripts
    assert sorted(name for name in names if is_setting_variable(name)) == []
