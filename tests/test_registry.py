"""The registry discovers real distributions through entry points, isolates broken
plugins, refuses API mismatches and duplicates, and applies allow/deny lists."""

import logging

import pytest

from kvforge.core import (
    API_VERSION,
    SCHEDULER_POLICY,
    DuplicateImplementationError,
    PluginError,
    SelectionError,
    build_registry,
)
from tests.conftest import policy_plugin


def test_third_party_distribution_is_discovered_and_selectable(fake_site):
    fake_site.add("fakeplug-lifo", "1.2.3", {"fakeplug_lifo": policy_plugin("lifo")}, {"lifo-plugin": "fakeplug_lifo"})
    registry = build_registry(environ={})
    registration = registry.select(SCHEDULER_POLICY, "lifo")
    assert registration.distribution == "fakeplug-lifo"
    assert registration.version == "1.2.3"
    assert registration.plugin == "lifo-plugin"
    assert registration.api_version == (1, 0)
    assert registration.cls.__module__ == "fakeplug_lifo"
    assert not registry.errors


def test_builtins_register_through_the_same_entry_points(fake_site):
    registry = build_registry(environ={})
    fcfs = registry.get(SCHEDULER_POLICY, "fcfs")
    assert fcfs.distribution == "kvforge"
    assert fcfs.plugin == "scheduler-policies"


def test_plugin_for_another_api_major_is_refused_with_both_versions(fake_site):
    other = (API_VERSION[0] + 1, 0)
    fake_site.add("fakeplug-future", "9.0.1", {"fakeplug_future": policy_plugin("future", api=other)},
                  {"future": "fakeplug_future"})
    registry = build_registry(environ={})
    assert "future" not in registry.names(SCHEDULER_POLICY)
    (error,) = registry.errors
    assert error.stage == "api_version"
    for fragment in ("'future'", "fakeplug-future", "9.0.1", f"{other[0]}.{other[1]}", f"{API_VERSION[0]}.{API_VERSION[1]}"):
        assert fragment in error.message


def test_plugin_for_another_api_major_is_told_to_get_a_build_for_this_major(fake_site):
    other = (API_VERSION[0] + 1, 0)
    fake_site.add("fakeplug-future", "9.0.1", {"fakeplug_future": policy_plugin("future", api=other)},
                  {"future": "fakeplug_future"})
    (error,) = build_registry(environ={}).errors
    assert f"install a version of fakeplug-future built for API {API_VERSION[0]}.x" in error.message


def test_plugin_needing_a_newer_minor_is_refused_and_told_to_upgrade_kvforge(fake_site):
    newer = (API_VERSION[0], API_VERSION[1] + 1)
    fake_site.add("fakeplug-newer", "1.0", {"fakeplug_newer": policy_plugin("newer", api=newer)}, {"newer": "fakeplug_newer"})
    registry = build_registry(environ={})
    (error,) = registry.errors
    assert error.stage == "api_version"
    # minors only add to the contract: the host is what is too old, not the plugin
    assert f"upgrade kvforge to a version offering API {newer[0]}.{newer[1]}" in error.message
    assert f"offers API {API_VERSION[0]}.{API_VERSION[1]}" in error.message
    assert "built for API" not in error.message


def test_plugin_raising_at_import_is_isolated_recorded_and_logged_once(fake_site, caplog):
    fake_site.add("fakeplug-broken", "0.1", {"fakeplug_broken": "raise RuntimeError('boom at import')"},
                  {"broken": "fakeplug_broken"})
    fake_site.add("fakeplug-good", "0.2", {"fakeplug_good": policy_plugin("good")}, {"good": "fakeplug_good"})
    with caplog.at_level(logging.WARNING, logger="kvforge.plugins"):
        registry = build_registry(environ={})
    (error,) = registry.errors
    assert (error.plugin, error.distribution, error.stage) == ("broken", "fakeplug-broken", "import")
    assert "boom at import" in error.message
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1
    assert "boom at import" in caplog.records[0].message
    assert "good" in registry.names(SCHEDULER_POLICY)
    assert "fcfs" in registry.names(SCHEDULER_POLICY)


def test_plugin_whose_hook_raises_is_isolated(fake_site):
    source = "from kvforge.core import hookimpl\n@hookimpl\ndef kvforge_implementations():\n    raise ValueError('hook broke')\n"
    fake_site.add("fakeplug-hook", "0.1", {"fakeplug_hook": source}, {"hook": "fakeplug_hook"})
    registry = build_registry(environ={})
    assert [(e.plugin, e.stage) for e in registry.errors] == [("hook", "register")]
    assert "hook broke" in registry.errors[0].message


def test_strict_mode_makes_a_broken_plugin_fatal(fake_site):
    fake_site.add("fakeplug-broken", "0.1", {"fakeplug_broken": "raise RuntimeError('boom')"}, {"broken": "fakeplug_broken"})
    with pytest.raises(PluginError, match="boom"):
        build_registry(strict=True, environ={})


def test_strict_mode_raises_one_error_listing_every_load_error(fake_site, caplog):
    fake_site.add("fakeplug-broken", "0.1", {"fakeplug_broken": "raise RuntimeError('boom at import')"},
                  {"a-broken": "fakeplug_broken"})
    fake_site.add("fakeplug-future", "9.0", {"fakeplug_future": policy_plugin("future", api=(API_VERSION[0] + 1, 0))},
                  {"b-future": "fakeplug_future"})
    fake_site.add("fakeplug-a", "1.0", {"fakeplug_a": policy_plugin("twin")}, {"c-twin": "fakeplug_a"})
    fake_site.add("fakeplug-b", "2.0", {"fakeplug_b": policy_plugin("twin")}, {"d-twin": "fakeplug_b"})
    with caplog.at_level(logging.WARNING, logger="kvforge.plugins"), pytest.raises(PluginError) as excinfo:
        build_registry(strict=True, environ={})
    message = str(excinfo.value)
    # mixed stages: the common base type, not the type of whichever failed first
    assert type(excinfo.value) is PluginError
    assert message.startswith("4 kvforge plugin load errors (plugins.strict is on)")
    for plugin, distribution, stage, fragment in [
        ("a-broken", "fakeplug-broken 0.1", "import", "boom at import"),
        ("b-future", "fakeplug-future 9.0", "api_version", f"kvforge API {API_VERSION[0] + 1}.0"),
        ("c-twin", "fakeplug-a 1.0", "duplicate", "'d-twin'"),
        ("d-twin", "fakeplug-b 2.0", "duplicate", "'c-twin'"),
    ]:
        (line,) = [line for line in message.splitlines() if f"plugin {plugin!r} ({distribution}) failed at {stage}" in line]
        assert fragment in line
    assert "plugins.strict=false" in message
    assert not caplog.records  # the raised error is the one report


def test_strict_mode_keeps_the_specific_type_when_every_error_shares_it(fake_site):
    fake_site.add("fakeplug-a", "1.0", {"fakeplug_a": policy_plugin("twin")}, {"twin-a": "fakeplug_a"})
    fake_site.add("fakeplug-b", "2.0", {"fakeplug_b": policy_plugin("twin")}, {"twin-b": "fakeplug_b"})
    with pytest.raises(DuplicateImplementationError, match="2 kvforge plugin load errors"):
        build_registry(strict=True, environ={})


def test_load_errors_can_be_recorded_without_logging(fake_site, caplog):
    fake_site.add("fakeplug-broken", "0.1", {"fakeplug_broken": "raise RuntimeError('boom')"}, {"broken": "fakeplug_broken"})
    with caplog.at_level(logging.WARNING, logger="kvforge.plugins"):
        registry = build_registry(environ={}, log_errors=False)
    assert [e.plugin for e in registry.errors] == ["broken"]
    assert not caplog.records


def test_duplicate_name_names_both_distributions_and_overrides_neither(fake_site):
    fake_site.add("fakeplug-a", "1.0", {"fakeplug_a": policy_plugin("twin")}, {"twin-a": "fakeplug_a"})
    fake_site.add("fakeplug-b", "2.0", {"fakeplug_b": policy_plugin("twin")}, {"twin-b": "fakeplug_b"})
    registry = build_registry(environ={})
    # neither plugin's 'twin' is registered, so each plugin has its own error row, naming both
    assert [(e.plugin, e.distribution, e.stage) for e in registry.errors] == [
        ("twin-a", "fakeplug-a", "duplicate"), ("twin-b", "fakeplug-b", "duplicate")]
    for error in registry.errors:
        assert "plugin 'twin-a' (fakeplug-a 1.0)" in error.message
        assert "plugin 'twin-b' (fakeplug-b 2.0)" in error.message
    with pytest.raises(DuplicateImplementationError, match="fakeplug-a.*fakeplug-b"):
        registry.get(SCHEDULER_POLICY, "twin")
    # denying one of them resolves the conflict
    resolved = build_registry(deny=["twin-b"], environ={})
    assert resolved.get(SCHEDULER_POLICY, "twin").distribution == "fakeplug-a"


def test_third_holder_of_a_name_is_named_in_every_duplicate_row(fake_site, caplog):
    for suffix in "abc":
        fake_site.add(f"fakeplug-{suffix}", "1.0", {f"fakeplug_{suffix}": policy_plugin("triplet")},
                      {f"triplet-{suffix}": f"fakeplug_{suffix}"})
    with caplog.at_level(logging.WARNING, logger="kvforge.plugins"):
        registry = build_registry(environ={})
    assert sorted(e.plugin for e in registry.errors) == ["triplet-a", "triplet-b", "triplet-c"]
    for error in registry.errors:
        assert all(f"plugin 'triplet-{s}' (fakeplug-{s} 1.0)" in error.message for s in "abc")
    assert len(caplog.records) == 3  # one line per plugin, none for the superseded two-holder rows


def test_duplicate_of_a_builtin_is_reported_not_silently_overridden(fake_site):
    fake_site.add("fakeplug-fcfs", "1.0", {"fakeplug_fcfs": policy_plugin("fcfs")}, {"my-fcfs": "fakeplug_fcfs"})
    registry = build_registry(environ={})
    with pytest.raises(DuplicateImplementationError) as excinfo:
        registry.get(SCHEDULER_POLICY, "fcfs")
    assert "plugin 'scheduler-policies' (kvforge " in str(excinfo.value)
    assert "plugin 'my-fcfs' (fakeplug-fcfs 1.0)" in str(excinfo.value)


def test_allow_and_deny_from_config(fake_site):
    fake_site.add("fakeplug-x", "1.0", {"fakeplug_x": policy_plugin("x")}, {"x-plugin": "fakeplug_x"})
    allowed = build_registry(allow=["x-plugin"], environ={})
    assert allowed.names(SCHEDULER_POLICY) == ["x"]
    assert "scheduler-policies" in allowed.skipped_plugins
    denied = build_registry(deny=["x-plugin"], environ={})
    assert "x" not in denied.names(SCHEDULER_POLICY)
    assert "fcfs" in denied.names(SCHEDULER_POLICY)


def test_allow_and_deny_from_the_environment(fake_site):
    fake_site.add("fakeplug-x", "1.0", {"fakeplug_x": policy_plugin("x")}, {"x-plugin": "fakeplug_x"})
    only_x = build_registry(environ={"KVFORGE_PLUGINS": "x-plugin"})
    assert only_x.names(SCHEDULER_POLICY) == ["x"]
    no_x = build_registry(environ={"KVFORGE_PLUGINS": "-x-plugin"})
    assert "x" not in no_x.names(SCHEDULER_POLICY) and "fcfs" in no_x.names(SCHEDULER_POLICY)
    # config and environment both apply: allowed by config, denied by the environment
    both = build_registry(allow=["x-plugin", "scheduler-policies"], environ={"KVFORGE_PLUGINS": "-x-plugin"})
    assert "x" not in both.names(SCHEDULER_POLICY)


def test_unknown_name_lists_valid_names_and_suggests_the_closest(fake_site):
    registry = build_registry(environ={})
    with pytest.raises(SelectionError) as excinfo:
        registry.select(SCHEDULER_POLICY, "priorty")
    message = str(excinfo.value)
    assert "fcfs" in message and "priority" in message and "did you mean 'priority'" in message


def test_invalid_registration_is_reported(fake_site):
    source = "from kvforge.core import hookimpl\n@hookimpl\ndef kvforge_implementations():\n    return [int]\n"
    fake_site.add("fakeplug-int", "0.1", {"fakeplug_int": source}, {"int": "fakeplug_int"})
    registry = build_registry(environ={})
    assert [e.stage for e in registry.errors] == ["invalid"]
