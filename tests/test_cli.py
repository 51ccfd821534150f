"""The `kvforge` command line, run as a user runs it: a separate process."""

import json
import os
import subprocess
import sys

from tests.conftest import policy_plugin


def kvforge(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvforge", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def test_plugins_json_lists_builtins_third_party_and_errors(fake_site, tmp_path):
    fake_site.add("fakeplug-cli", "3.1", {"fakeplug_cli": policy_plugin("cli-policy")}, {"cli": "fakeplug_cli"})
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "import not_a_module_anywhere"}, {"bad": "fakeplug_bad"})
    result = kvforge("plugins", "--json", "--explain", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == 1
    by_name = {(i["kind"], i["name"]): i for i in data["implementations"]}
    assert by_name[("scheduler_policy", "fcfs")]["distribution"] == "kvforge"
    third = by_name[("scheduler_policy", "cli-policy")]
    assert (third["distribution"], third["version"], third["plugin"], third["available"]) == ("fakeplug-cli", "3.1", "cli", True)
    (error,) = data["errors"]
    assert error["plugin"] == "bad" and error["stage"] == "import" and "not_a_module_anywhere" in error["message"]
    assert set(data["explain"]) == {"attention_backend", "block_allocator", "scheduler_policy", "quantizer", "speculative_proposer"}
    assert data["explain"]["scheduler_policy"]["chosen"] == "fcfs"


def test_plugins_table_shows_load_errors(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('missing dependency foo')"}, {"bad": "fakeplug_bad"})
    result = kvforge("plugins", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 0
    assert "plugin load errors" in result.stdout and "missing dependency foo" in result.stdout


def test_plugins_strict_from_config_fails(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('nope')"}, {"bad": "fakeplug_bad"})
    result = kvforge("plugins", "--set", "plugins.strict=true", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 2 and "plugins.strict is on" in result.stderr


def test_config_show_prints_values_with_sources(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[cache]\nblock_size = 32\n")
    result = kvforge("config", "show", "--json", "--config", str(toml), "--set", "scheduler.max_num_seqs=7",
                     env={"KVFORGE_SEED": "11"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {row["key"]: row for row in json.loads(result.stdout)}
    assert rows["cache.block_size"] == {"key": "cache.block_size", "value": 32, "source": f"file {toml}"}
    assert rows["scheduler.max_num_seqs"]["source"] == "--set"
    assert rows["seed"] == {"key": "seed", "value": 11, "source": "env KVFORGE_SEED"}
    table = kvforge("config", "show", "--config", str(toml), cwd=tmp_path)
    assert "cache.block_size" in table.stdout and "file" in table.stdout


def test_config_show_rejects_invalid_values_with_the_message(tmp_path):
    result = kvforge("config", "show", "--set", "scheduler.policy=fcsf", cwd=tmp_path)
    assert result.returncode != 0
    assert "scheduler.policy" in result.stderr and "did you mean 'fcfs'" in result.stderr
    result = kvforge("config", "show", "--set", "cache.block_size=-4", cwd=tmp_path)
    assert result.returncode != 0 and "cache.block_size" in result.stderr


def test_conformance_runner_reports_a_failing_third_party_plugin(fake_site, tmp_path):
    # the fake policy orders last-in-first-out, which breaks "earlier arrival goes first"
    fake_site.add("fakeplug-lifo", "1.0", {"fakeplug_lifo": policy_plugin("lifo")}, {"lifo": "fakeplug_lifo"})
    env = {"PYTHONPATH": str(fake_site.root)}
    bad = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "lifo", env=env, cwd=tmp_path)
    assert bad.returncode == 1
    assert "lifo" in bad.stdout and "FAIL" in bad.stdout
    good = kvforge("conformance", "--kind", "scheduler_policy", "--plugin", "fcfs", env=env, cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "pass" in good.stdout


def test_module_and_console_script_agree(tmp_path):
    result = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvforge"), "--help"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "plugins" in result.stdout and "conformance" in result.stdout
