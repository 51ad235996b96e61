"""Settings: one name each as flag, environment variable and TOML key; flag > env > file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from seedance.config import OPTIONS, PLAIN_FIELDS, SECTIONS, ConfigError, ServerConfig
from seedance.config_loader import load_config
from seedance.engines.llamacpp import LlamaCppOptions
from seedance.engines.registry import create_engine, engine_specs
from seedance.engines.synthetic import SyntheticOptions


def test_defaults() -> None:
    config = load_config({}, {})
    assert config == ServerConfig(engine_options=LlamaCppOptions())
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


def test_trusted_proxies_are_addresses_networks_or_any() -> None:
    assert load_config({}, {}).trusted_proxies == ("127.0.0.1", "::1")
    flags = {"trusted_proxies": "10.1.2.3, 192.168.0.0/16,::1"}
    assert load_config(flags, {}).trusted_proxies == ("10.1.2.3", "192.168.0.0/16", "::1")
    assert load_config({"trusted_proxies": "*"}, {}).trusted_proxies == ("*",)
    assert load_config({}, {"SEEDANCE_TRUSTED_PROXIES": ""}).trusted_proxies == ()


def test_every_option_has_an_env_name_and_a_field() -> None:
    """Each setting is one field, of the config or of one of its sections, and a field that
    is a setting is declared once (its flag, variable and TOML keys come from there)."""
    sections = set(SECTIONS)
    fields = set(ServerConfig.__dataclass_fields__) - set(PLAIN_FIELDS) - sections
    fields |= {f"{s}.{f}" for s in sections for f in SECTIONS[s].__dataclass_fields__}
    assert {
        opt.attr if opt.section is None else f"{opt.section}.{opt.attr}" for opt in OPTIONS
    } == fields
    assert len({opt.field for opt in OPTIONS}) == len(OPTIONS)  # flat names, each once
    names = {opt.env for opt in OPTIONS}
    assert "SEEDANCE_HEARTBEAT_INTERVAL" in names and "SEEDANCE_PARALLEL" not in names


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"port": "70000"}, {}, "--port: must be between 0 and 65535"),
        ({"port": "eighty"}, {}, "--port: invalid value 'eighty'"),
        ({}, {"SEEDANCE_IDLE_TIMEOUT": "-1"}, "SEEDANCE_IDLE_TIMEOUT: must be positive"),
        ({}, {"SEEDANCE_LOG_PROMPTS": "perhaps"}, "SEEDANCE_LOG_PROMPTS: invalid value"),
        ({"log_level": "loud"}, {}, "--log-level: must be one of"),
        ({"config": "/nonexistent/seedance.toml"}, {}, "config file not found"),
        ({"trusted_proxies": "10.0.0.0/8,balancer"}, {}, "--trusted-proxies: invalid value"),
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
    for name, spec in engine_specs().items():
        assert not isinstance(spec, Exception), spec
        section = text.partition(f"### `{name}`")[2].partition("###")[0]
        for opt in spec.declared:
            assert f"| `{opt.flag}` | `{opt.env}` | `{opt.key}` |" in section, (name, opt.flag)


def test_boolean_flags_work_alone() -> None:
    from seedance.cli import _parser

    args = _parser().parse_args(["serve", "--log-prompts", "--port", "0"])
    assert load_config(vars(args), {}).log_prompts is True
    args = _parser().parse_args(["serve", "--log-prompts", "false"])
    assert load_config(vars(args), {}).log_prompts is False


# --------------------------------------------------------------------------- engine options


def test_an_engine_takes_its_own_flags_and_environment() -> None:
    flags = {"engine": "synthetic", "synthetic_tokens_per_s": "50"}
    env = {"SEEDANCE_SYNTHETIC_TTFT_MS": "20", "SEEDANCE_PARALLEL": "4"}  # not synthetic's
    config = load_config(flags, env)
    assert config.engine_options == SyntheticOptions(ttft_ms=20.0, tokens_per_s=50.0)
    engine = create_engine(config)
    assert engine.info.engine == "synthetic"
    llama = load_config({"parallel": "2"}, {"SEEDANCE_PARALLEL": "4", "SEEDANCE_N_CTX": "4096"})
    assert llama.engine_options == LlamaCppOptions(parallel=2, n_ctx=4096)


def test_a_flag_of_another_engine_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"--parallel is an option of the llamacpp, transformers engines, "
        r"not of --engine synthetic",
    ):
        load_config({"engine": "synthetic", "parallel": "2"}, {})
    with pytest.raises(ConfigError, match="--synthetic-tokens-per-s: must be 0 or more"):
        load_config({"engine": "synthetic", "synthetic_tokens_per_s": "-1"}, {})


def test_engine_tables_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text(
        'engine = "llamacpp"\n'
        "[engines.llamacpp]\nparallel = 4\nn_ctx = 8192\nkv_reuse = false\n"
        "[engines.synthetic]\nsynthetic_tokens_per_s = 100\n"
    )
    options = load_config({"config": str(path)}, {"SEEDANCE_N_CTX": "2048"}).engine_options
    assert options == LlamaCppOptions(parallel=4, n_ctx=2048, kv_reuse=False)  # env > file
    options = load_config({"config": str(path), "parallel": "2"}, {}).engine_options
    assert options.parallel == 2  # flag > file
    synthetic = load_config({"config": str(path), "engine": "synthetic"}, {}).engine_options
    assert synthetic == SyntheticOptions(tokens_per_s=100.0)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "parallel = 4\n",
            "'parallel' is an option of the llamacpp, transformers engines: "
            "set it in the [engines.llamacpp] table",
        ),
        (
            "[engines.llamacpp]\nparalel = 4\n",
            "[engines.llamacpp]: unknown setting 'paralel' (the llamacpp engine's: parallel, n_ctx",
        ),
        (
            "[engines.vllm]\ngpu_memory_utilization = 2\n",  # checked though not served
            "engines.vllm.gpu_memory_utilization: must be above 0 and at most 1",
        ),
        ("[engines.nope]\nx = 1\n", "[engines.nope]: unknown engine 'nope'"),
        ("engines = 1\n", "engines: expected a table"),
        ("[engines]\nllamacpp = 1\n", "engines.llamacpp: expected a table"),
    ],
)
def test_bad_engine_tables(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config({"config": str(path)}, {})


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tests/support/options_plugin.py installed as the engines ``named`` (an EngineSpec with
    its own option) and ``plain`` (a plain factory)."""
    info = tmp_path / "options_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: options-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[seedance.engines]\n"
        "named = tests.support.options_plugin:ENGINE\n"
        "plain = tests.support.options_plugin:factory\n"
        "broken = tests.support.no_such_module:ENGINE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_third_party_engine_declares_options_the_same_way(plugins: Path) -> None:
    from seedance.cli import _parser

    args = _parser().parse_args(["serve", "--engine", "named", "--serve-as", "mine"])
    engine = create_engine(load_config(vars(args), {}))
    assert engine.info.name == "mine"
    path = plugins / "c.toml"
    path.write_text('engine = "named"\n[engines.named]\nserve_as = "from-file"\n')
    assert create_engine(load_config({"config": str(path)}, {})).info.name == "from-file"
    assert create_engine(load_config({"engine": "plain"}, {})).info.name == "plain"
    with pytest.raises(ConfigError, match="--serve-as is an option of the named engine"):
        load_config({"engine": "plain", "serve_as": "x"}, {})
    with pytest.raises(ConfigError, match=r"engine 'broken' .* cannot be loaded: ModuleNotFound"):
        load_config({"engine": "broken"}, {})


def test_help_groups_flags_by_engine(plugins: Path) -> None:
    from seedance.cli import _parser

    serve = _parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    groups = [line for line in text.splitlines() if line.startswith("--engine ")]
    assert groups[0] == "--engine llamacpp:"  # the default engine first, then by name
    assert "--engine named:" in groups and "--engine vllm:" in groups
    transformers = text.partition("--engine transformers:")[2].partition("--engine ")[0]
    assert "Also takes --parallel, --n-ctx, --threads, --chat-template (above)." in " ".join(
        transformers.split()
    )
    assert "--serve-as" in text.partition("--engine named:")[2]
    assert text.count("  --parallel") == 1  # one flag, shown where first declared


def test_each_section_has_its_table_and_its_top_level_keys(tmp_path: Path) -> None:
    """A setting of a section may be given in the section's table or at the top level, and
    lands in its section either way (``config.resume.grace_s``)."""
    path = tmp_path / "seedance.toml"
    path.write_text('[resume]\ngrace = 5\n[tls]\ncert = "c.pem"\nkey = "k.pem"\n')
    config = load_config({"config": str(path)})
    assert config.resume.grace_s == 5.0 and (config.tls.cert, config.tls.key) == ("c.pem", "k.pem")
    path.write_text("resume_grace = 7\n[handshake]\ntimeout = 3\n")
    config = load_config({"config": str(path)}, {"SEEDANCE_RESUME_WINDOW": "9"})
    assert (config.resume.grace_s, config.resume.window_s) == (7.0, 9.0)
    assert config.handshake.timeout_s == 3.0
    path.write_text("[e2e]\nkeys = 1\n")
    with pytest.raises(ConfigError, match=r"\[e2e\]: unknown setting 'keys' \(its settings: key, "):
        load_config({"config": str(path)})
    assert ServerConfig.of(audit_file="a.log").replace(lease_s=2).cluster.lease_s == 2
