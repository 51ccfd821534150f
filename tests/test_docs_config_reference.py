"""docs/config_reference.md is generated from the pydantic models in
`kvforge.core.config` and stays true to them: the committed page is what the
generator writes now, every setting is on it with a description, and the default
and environment variable printed beside each are the ones the config loader uses."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from pydantic import Field

from kvforge.core import EngineConfig, load_config
from kvforge.core.config_sources import flatten

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
config_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(config_reference)

ROW = re.compile(r"^\| `(?P<key>[\w.]+)`<br>`(?P<env>\w+)` \| (?P<type>[^|]+) \| `(?P<default>.*?)` \| "
                 r"(?P<allowed>(?:[^|]|\\\|)*) \| (?P<description>.*) \|$")


def page_rows(page: str) -> dict[str, dict[str, str]]:
    return {match["key"]: match.groupdict() for match in map(ROW.match, page.splitlines()) if match}


def test_committed_page_is_what_the_models_generate():
    committed = (ROOT / "docs" / "config_reference.md").read_text()
    assert committed == config_reference.render(), (
        "docs/config_reference.md is out of date with kvforge.core.config; regenerate it with "
        "`python scripts/config_reference.py` and commit the result")


def test_every_setting_is_on_the_page_with_a_description():
    rows = page_rows(config_reference.render())
    settings = [key for key, _ in flatten(EngineConfig().model_dump())]
    assert sorted(rows) == sorted(settings)
    undocumented = [key for key, row in rows.items() if not row["description"].strip()]
    assert not undocumented, f"give these fields a description= in core/config.py: {undocumented}"


def test_a_field_added_to_the_models_shows_up_and_makes_the_committed_page_stale():
    class GrownConfig(EngineConfig):
        max_model_len: int = Field(4096, ge=16, description="longest sequence")

    page = config_reference.render(GrownConfig)
    row = page_rows(page)["max_model_len"]
    assert (row["env"], row["type"], row["default"], row["allowed"]) == \
        ("KVFORGE_MAX_MODEL_LEN", "integer", "4096", "≥ 16")
    assert page != (ROOT / "docs" / "config_reference.md").read_text()


@pytest.mark.parametrize("key", [key for key, _ in flatten(EngineConfig().model_dump())])
def test_printed_default_and_environment_variable_are_the_loaders(key):
    row = page_rows(config_reference.render())[key]
    default = EngineConfig().model_dump()
    for part in key.split("."):
        default = default[part]
    if row["default"] == "none":
        assert default is None
        return
    assert tomllib.loads(f"v = {row['default']}")["v"] == default
    loaded = load_config(environ={row["env"]: row["default"]})
    assert loaded.sources[key] == f"env {row['env']}", f"{row['env']} does not set {key}"


def test_implementation_fields_say_which_kind_they_name():
    rows = page_rows(config_reference.render())
    assert "`auto` or a registered `attention_backend` name" in rows["attention.backend"]["allowed"]
    assert "none or a registered `speculative_proposer` name" in rows["speculative.proposer"]["allowed"]
    assert "`bfloat16`, or a registered `quantizer` name" in rows["cache.kv_cache_dtype"]["allowed"]
    assert rows["device"]["allowed"] == "`auto`, `cpu`, `cuda`"
    assert rows["cache.block_size"]["allowed"] == "1 to 1024"


def test_check_mode_exits_non_zero_on_a_stale_page(tmp_path, monkeypatch):
    stale = tmp_path / "config_reference.md"
    stale.write_text("# out of date\n")
    monkeypatch.setattr(config_reference, "PAGE", stale)
    assert config_reference.main(["--check"]) == 1
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0
