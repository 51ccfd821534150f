"""Configuration: five sources in a fixed precedence, every value's source
remembered, and errors that name the field, the bad value and the choices."""

import pytest

from kvforge.core import ConfigError, EngineConfig, check_implementation_names, load_config


def test_each_source_overrides_the_previous_and_is_recorded(tmp_path):
    toml = tmp_path / "kvforge.toml"
    toml.write_text('model = "from-file"\n[cache]\nblock_size = 8\nnum_blocks = 100\nallocator = "file-alloc"\n'
                    '[scheduler]\nmax_num_seqs = 3\nmax_num_batched_tokens = 64\npolicy = "file-policy"\n')
    environ = {"KVFORGE_CACHE__NUM_BLOCKS": "200", "KVFORGE_SCHEDULER__MAX_NUM_SEQS": "4",
               "KVFORGE_SCHEDULER__POLICY": "env-policy", "KVFORGE_DTYPE": "bfloat16", "UNRELATED": "x"}
    loaded = load_config(toml, environ=environ,
                         overrides=["scheduler.max_num_seqs=5", "scheduler.policy=cli-policy"],
                         scheduler={"policy": "python-policy"})
    config = loaded.config
    assert config.model == "from-file" and loaded.sources["model"] == f"file {toml}"
    assert config.cache.block_size == 8
    assert config.cache.num_blocks == 200 and loaded.sources["cache.num_blocks"] == "env KVFORGE_CACHE__NUM_BLOCKS"
    assert config.dtype == "bfloat16" and loaded.sources["dtype"] == "env KVFORGE_DTYPE"
    assert config.scheduler.max_num_seqs == 5 and loaded.sources["scheduler.max_num_seqs"] == "--set"
    assert config.scheduler.policy == "python-policy" and loaded.sources["scheduler.policy"] == "python"
    assert config.scheduler.max_num_batched_tokens == 64
    assert config.attention.backend == "auto" and "attention.backend" not in loaded.sources
    rows = {key: source for key, _, source in loaded.rows()}
    assert rows["attention.backend"] == "default" and rows["cache.allocator"] == f"file {toml}"


def test_defaults_alone_validate():
    config = load_config(environ={}).config
    assert config == EngineConfig()
    assert config.cache.block_size == 16 and config.attention.backend == "auto"


def test_cli_and_env_values_are_parsed_as_toml_literals():
    config = load_config(environ={"KVFORGE_PLUGINS__DENY": '["a", "b"]'},
                         overrides=["cache.enable_prefix_caching=false", "cache.memory_budget=0.25"]).config
    assert config.plugins.deny == ["a", "b"]
    assert config.cache.enable_prefix_caching is False
    assert config.cache.memory_budget == 0.25


def test_plugins_filter_variable_is_not_mistaken_for_a_setting():
    assert load_config(environ={"KVFORGE_PLUGINS": "-foo"}).config.plugins.deny == []


@pytest.mark.parametrize("text, expected", [("4GiB", 4 * 2**30), ("512MB", 512e6), ("1000", 1000), ("0.5", 0.5)])
def test_memory_budget_accepts_sizes_and_fractions(text, expected):
    assert load_config(environ={}, overrides=[f"cache.memory_budget={text}"]).config.cache.memory_budget == expected


@pytest.mark.parametrize("override, fragments", [
    ("cache.block_size=abc", ["cache.block_size", "'abc'", "integer"]),
    ("cache.block_size=0", ["cache.block_size", "0", "greater than or equal to 1"]),
    ("device=tpu", ["device", "'tpu'", "'auto'", "'cpu'", "'cuda'"]),
    ("dtype=float64", ["dtype", "'float64'", "'bfloat16'"]),
    ("cache.memory_budget=-3", ["cache.memory_budget", "fraction"]),
    ("cache.memory_budget=lots", ["cache.memory_budget", "'lots'", "4GiB"]),
    ("scheduler.max_num_seqs=-1", ["scheduler.max_num_seqs", "-1"]),
])
def test_invalid_values_name_the_field_the_value_and_the_choices(override, fragments):
    with pytest.raises(ConfigError) as excinfo:
        load_config(environ={}, overrides=[override])
    for fragment in fragments:
        assert fragment in str(excinfo.value)


def test_unknown_setting_suggests_the_closest_and_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown setting 'cache.blok_size'.*did you mean 'cache.block_size'"):
        load_config(environ={}, overrides=["cache.blok_size=8"])
    with pytest.raises(ConfigError, match="env KVFORGE_CACHE__BLOK_SIZE"):
        load_config(environ={"KVFORGE_CACHE__BLOK_SIZE": "8"})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(environ={}, cache={"colour": "blue"})


def test_malformed_set_and_missing_file_are_explained(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(environ={}, overrides=["cache.block_size"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})


class _Names:
    def __init__(self, names):
        self._names = names

    def names(self, kind):
        return self._names.get(kind, [])


def test_implementation_names_are_checked_against_the_registry():
    registry = _Names({"attention_backend": ["reference", "sdpa", "triton"], "scheduler_policy": ["fcfs"]})
    config = load_config(environ={}, attention={"backend": "tritn"}).config
    with pytest.raises(ConfigError) as excinfo:
        check_implementation_names(config, registry)
    message = str(excinfo.value)
    assert "attention.backend" in message and "'tritn'" in message
    assert "reference, sdpa, triton" in message and "did you mean 'triton'" in message
    check_implementation_names(load_config(environ={}, attention={"backend": "sdpa"}).config, registry)


def test_kv_cache_dtype_other_than_a_float_must_name_a_quantizer():
    config = load_config(environ={}, cache={"kv_cache_dtype": "fp8"}).config
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype.*unknown quantizer 'fp8'"):
        check_implementation_names(config, _Names({}))
    check_implementation_names(load_config(environ={}, cache={"kv_cache_dtype": "bfloat16"}).config, _Names({}))


def test_kv_cache_dtype_naming_a_quantizer_that_cannot_keep_a_kv_cache_is_refused_at_resolution():
    from kvforge.core import build_registry

    registry = build_registry()
    config = load_config(environ={}, cache={"kv_cache_dtype": "int8_weight"}).config
    with pytest.raises(ConfigError, match=r"cache.kv_cache_dtype: quantizer 'int8_weight' \(per_channel\) cannot "
                                          r"quantize a KV cache.*valid choices: auto, float32, .*quantizer: .*int8"):
        check_implementation_names(config, registry)
    for kv_capable in ("int8", "fp8_e4m3_per_tensor", "auto"):
        check_implementation_names(load_config(environ={}, cache={"kv_cache_dtype": kv_capable}).config, registry)


def test_a_dict_valued_setting_is_one_setting_from_every_source(tmp_path):
    # speculative.options is a dict the proposer reads, not a config section: its keys are the proposer's.
    toml = tmp_path / "kvforge.toml"
    toml.write_text('[speculative]\nproposer = "ngram"\noptions = { min_n = 1 }\n')
    assert load_config(toml, environ={}).config.speculative.options == {"min_n": 1}
    loaded = load_config(environ={}, speculative={"options": {"min_n": 1, "max_n": 3}})
    assert loaded.config.speculative.options == {"min_n": 1, "max_n": 3}
    assert ("speculative.options", {"min_n": 1, "max_n": 3}, "python") in loaded.rows()
    assert load_config(environ={}, overrides=["speculative.options={max_n=2}"]).config.speculative.options == {"max_n": 2}
