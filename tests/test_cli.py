"""The `kvforge` command line, run as a user runs it: a separate process."""

import io
import json
import os
import subprocess
import sys

from rich.console import Console

from kvforge.cli_plugins import print_report, report
from kvforge.core import KINDS, build_registry
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
    assert set(data["explain"]) == {"attention_backend", "block_allocator", "scheduler_policy", "quantizer", "speculative_proposer",
                                   "structured_output"}
    assert data["explain"]["scheduler_policy"]["chosen"] == "fcfs"
    by_spec = data["explain"]["structured_output"]["by_spec"]
    assert by_spec["json"] == "xgrammar" and by_spec["grammar (lark)"] == "llguidance"


def test_plugins_table_shows_load_errors(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('missing dependency foo')"}, {"bad": "fakeplug_bad"})
    result = kvforge("plugins", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 0
    assert "plugin load errors" in result.stdout and "missing dependency foo" in result.stdout


def test_plugins_prints_each_load_error_once(fake_site, tmp_path):
    # the table shows it; a logged warning on stderr as well would be a second copy
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('zq-missing-dep')"}, {"bad": "fakeplug_bad"})
    for args in (("plugins",), ("plugins", "--json")):
        result = kvforge(*args, env={"PYTHONPATH": str(fake_site.root), "COLUMNS": "200"}, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (result.stdout + result.stderr).count("zq-missing-dep") == 1, (result.stdout, result.stderr)


def render_plugins_at_80_columns(registry) -> str:
    out = io.StringIO()
    print_report(report(registry, None, explain=False), Console(file=out, width=80, color_system=None))
    return out.getvalue()


def test_plugins_tables_keep_every_kind_and_name_whole_at_80_columns(fake_site):
    fake_site.add("fakeplug-long-distribution-name", "10.20.30",
                  {"fakeplug_long": policy_plugin("a-rather-long-policy-name")}, {"long": "fakeplug_long"})
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('a long reason ' * 8)"},
                  {"bad": "fakeplug_bad"})
    registry = build_registry(environ={}, log_errors=False)
    text = render_plugins_at_80_columns(registry)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # rich's mark of a cut cell
    words = set(text.replace("│", " ").split())
    for kind in KINDS:
        assert kind in words, f"{kind} is not shown whole:\n{text}"
    for registration in registry.implementations():
        assert registration.name in words, f"{registration.name} is not shown whole:\n{text}"


def test_plugins_duplicate_row_names_both_plugins(fake_site):
    fake_site.add("fakeplug-a", "1.0", {"fakeplug_a": policy_plugin("twin")}, {"twin-a": "fakeplug_a"})
    fake_site.add("fakeplug-b", "2.0", {"fakeplug_b": policy_plugin("twin")}, {"twin-b": "fakeplug_b"})
    data = report(build_registry(environ={}, log_errors=False), None, explain=False)
    assert sorted(e["plugin"] for e in data["errors"]) == ["twin-a", "twin-b"]
    for error in data["errors"]:
        assert "'twin-a' (fakeplug-a 1.0)" in error["message"] and "'twin-b' (fakeplug-b 2.0)" in error["message"]


def test_plugins_strict_from_config_fails(fake_site, tmp_path):
    fake_site.add("fakeplug-bad", "0.1", {"fakeplug_bad": "raise ImportError('nope')"}, {"bad": "fakeplug_bad"})
    fake_site.add("fakeplug-worse", "0.2", {"fakeplug_worse": "raise ImportError('neither')"}, {"worse": "fakeplug_worse"})
    result = kvforge("plugins", "--set", "plugins.strict=true", env={"PYTHONPATH": str(fake_site.root)}, cwd=tmp_path)
    assert result.returncode == 2 and "plugins.strict is on" in result.stderr
    # every load error in the one message, each once
    assert result.stderr.count("nope") == 1 and result.stderr.count("neither") == 1, result.stderr


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


def test_config_show_and_generate_both_refuse_a_weight_only_quantizer_as_kv_cache_dtype(tmp_path):
    show = kvforge("config", "show", "--set", "cache.kv_cache_dtype=int8_weight", cwd=tmp_path)
    generate = kvforge("generate", "--set", "cache.kv_cache_dtype=int8_weight", "--max-tokens", "1", "hi", cwd=tmp_path)
    for result in (show, generate):
        assert result.returncode == 2, result.stdout + result.stderr
        assert "cache.kv_cache_dtype: quantizer 'int8_weight' (per_channel) cannot quantize a KV cache" in result.stderr
        assert "valid choices: auto, float32, float16, bfloat16, or a KV-capable quantizer: " in result.stderr
        assert "int8," in result.stderr and "fp8_e4m3_per_tensor" in result.stderr
        assert "int8_weight," not in result.stderr.split("valid choices")[1]
    assert kvforge("config", "show", "--set", "cache.kv_cache_dtype=int8", cwd=tmp_path).returncode == 0


def test_plugins_explain_and_tables_print_brackets_in_plugin_text_as_written():
    data = {"api_version": [1, 2], "errors": [], "skipped_plugins": ["extra[x]"], "implementations": [
        {"kind": "attention_backend", "name": "fast", "distribution": "fast-attn[cuda]", "version": "1.0",
         "api_version": [1, 2], "available": False, "reason": "pip install kvforge[triton]", "capabilities": {}}],
        "explain": {"attention_backend": {"chosen": "sdpa", "candidates": [
            {"name": "sdpa", "usable": True, "why_not": ""},
            {"name": "fast", "usable": False, "why_not": "unavailable: pip install kvforge[triton]"}]}}}
    out = io.StringIO()
    print_report(data, Console(file=out, width=200))
    text = out.getvalue()
    assert "skipped fast: unavailable: pip install kvforge[triton]" in text
    assert "no: pip install kvforge[triton]" in text and "fast-attn[cuda]" in text
    assert "skipped by allow/deny: extra[x]" in text


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
