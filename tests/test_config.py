"""Settings: one name each as flag, environment variable and TOML key; flag > env > file."""

from __future__ import annotations

from pathlib import Path

import pytest

from seedance.config import OPTIONS, TABLE_FIELDS, ConfigError, ServerConfig, load_config


def test_defaults() -> None:
    config = load_config({}, {})
    assert config == ServerConfig()
    assert (config.host, config.port, config.engine) == ("127.0.0.1", 8000, "llamacpp")
    assert (config.heartbeat_interval_s, config.idle_timeout_s) == (25.0, 30.0)
    assert (config.session_ttl_s, config.max_waiting, config.max_frame_bytes) == (
        1800.0,
        1024,
        1024 * 1024,
    )


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text(
        'port = 9000\nidle_timeout = 12\nlog_level = "DEBUG"\nlog_prompts = true\n'
        'host = "0.0.0.0"\n'
    )
    env = {"SEEDANCE_PORT": "9100", "SEEDANCE_IDLE_TIMEOUT": "13.5", "SEEDANCE_CONFIG": str(path)}
    config = load_config({"port": "9200"}, env)
    assert config.port == 9200
    assert config.idle_timeout_s == 13.5
    assert config.log_level == "debug" and config.log_prompts is True
    assert config.host == "0.0.0.0"
    assert load_config({"config": str(path)}, {}).port == 9000


def test_every_option_has_an_env_name_and_a_field() -> None:
    fields = set(ServerConfig.__dataclass_fields__) - set(TABLE_FIELDS)
    assert {opt.field for opt in OPTIONS} == fields
    names = {opt.env for opt in OPTIONS}
    assert "SEEDANCE_HEARTBEAT_INTERVAL" in names and "SEEDANCE_SYNTHETIC_TTFT_MS" in names


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"port": "70000"}, {}, "--port: must be between 0 and 65535"),
        ({"port": "eighty"}, {}, "--port: invalid value 'eighty'"),
        ({}, {"SEEDANCE_IDLE_TIMEOUT": "-1"}, "SEEDANCE_IDLE_TIMEOUT: must be positive"),
        ({}, {"SEEDANCE_LOG_PROMPTS": "perhaps"}, "SEEDANCE_LOG_PROMPTS: invalid value"),
        ({"log_level": "loud"}, {}, "--log-level: must be one of"),
        ({"config": "/nonexistent/seedance.toml"}, {}, "config file not found"),
    ],
)
def test_bad_values_name_their_source(
    flags: dict[str, str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(flags, env)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port = 'x'\n", "port: invalid value 'x'"),
        ("port = 1.5\n", "port: invalid value 1.5"),
        ("log_prompts = 1\n", "log_prompts: invalid value 1"),
        ("idle_timeout = true\n", "idle_timeout: invalid value True"),
        ("unknown_key = 1\n", "unknown setting 'unknown_key'"),
        ("port = \n", "invalid TOML"),
    ],
)
def test_bad_toml(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config({"config": str(path)}, {})


def test_docs_list_every_setting() -> None:
    text = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for opt in OPTIONS:
        assert f"| `{opt.flag}` | `{opt.env}` | `{opt.key}` |" in text, opt.flag


def test_boolean_flags_work_alone() -> None:
    from seedance.cli import _parser

    args = _parser().parse_args(["serve", "--log-prompts", "--port", "0"])
    assert load_config(vars(args), {}).log_prompts is True
    args = _parser().parse_args(["serve", "--log-prompts", "false"])
    assert load_config(vars(args), {}).log_prompts is False
