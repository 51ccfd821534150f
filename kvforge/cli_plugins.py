"""`kvforge plugins`: every registered implementation and every plugin load error.

The `--json` schema (version 1) is stable:
    {"schema": 1, "api_version": [major, minor],
     "implementations": [{"kind", "name", "plugin", "distribution", "version",
                          "api_version": [major, minor], "available": bool,
                          "reason": str, "capabilities": {...}}],
     "errors": [{"plugin", "distribution", "version", "stage", "message"}],
     "skipped_plugins": [entry-point names filtered out by allow/deny],
     "explain": {kind: {"chosen": name or null,
                        "candidates": [{"name", "usable", "why_not"}]}}   # only with --explain
    }
structured_output's entry also has "by_spec": {spec label: name or null}, what `auto`
picks for a request of each spec kind (and grammar syntax) the registered backends name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvforge.core import (
    API_VERSION,
    FLOAT_DTYPES,
    KINDS,
    PER_TOKEN,
    QUANTIZER,
    SPEC_KINDS,
    STRUCTURED_OUTPUT,
    SelectionRequest,
    StructuredOutputSpec,
)

from .cli_options import add_config_options, config_from_args, registry_from_config

SCHEMA_VERSION = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("plugins", help="list registered implementations and plugin errors")
    parser.add_argument("--json", action="store_true", help="print the stable JSON schema instead of tables")
    parser.add_argument("--explain", action="store_true", help="say which implementation auto picks per kind, and why not the others")
    add_config_options(parser)
    parser.set_defaults(run=run)


def selection_request(config, registry) -> SelectionRequest:
    """What `auto` is asked for when no model is loaded: the configured device,
    dtype, block size, `batch_invariant` and, when `cache.kv_cache_dtype` names a
    quantizer, the storage dtype it keeps the KV cache in (model shape is unknown
    until a model is)."""
    import torch

    from kvforge.engine.components import resolve_kv_quantizer
    from kvforge.models.base import backend_request

    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = FLOAT_DTYPES[config.dtype] if config.dtype != "auto" else None
    request = backend_request([], device, dtype, block_size=config.cache.block_size,
                              kv_quantizer=resolve_kv_quantizer(registry, config))
    return dataclasses.replace(request, kv_cache_dtype=config.cache.kv_cache_dtype,
                               prefix_caching=config.cache.enable_prefix_caching or None,
                               batch_invariant=config.batch_invariant)


def report(registry, request: SelectionRequest | None, explain: bool) -> dict:
    implementations = []
    for registration in registry.implementations():
        available = registration.availability()
        implementations.append({
            "kind": registration.kind, "name": registration.name, "plugin": registration.plugin,
            "distribution": registration.distribution, "version": registration.version,
            "api_version": list(registration.api_version), "available": available.ok,
            "reason": available.reason, "capabilities": registration.cls.capabilities(),
        })
    data = {"schema": SCHEMA_VERSION, "api_version": list(API_VERSION), "implementations": implementations,
            "errors": [asdict(e) for e in registry.errors], "skipped_plugins": registry.skipped_plugins}
    if explain:
        data["explain"] = {}
        for kind in KINDS:
            candidates = registry.candidates(kind, request)
            chosen = next((c.registration.name for c in candidates if c.usable), None)
            data["explain"][kind] = {"chosen": chosen, "candidates": [
                {"name": c.registration.name, "usable": c.usable, "why_not": c.why_not()} for c in candidates]}
        data["explain"][STRUCTURED_OUTPUT]["by_spec"] = structured_choices(registry, request)
    return data


def structured_choices(registry, request: SelectionRequest | None) -> dict[str, str | None]:
    """What `auto` picks for a request of each spec kind (a grammar per syntax some
    backend reads): structured_output backends are chosen per request, by its spec."""
    syntaxes = sorted({s for r in registry.implementations(STRUCTURED_OUTPUT) for s in r.cls.grammar_syntaxes})
    specs = [StructuredOutputSpec(kind) for kind in SPEC_KINDS if kind != "grammar"]
    specs += [StructuredOutputSpec("grammar", grammar_syntax=syntax) for syntax in syntaxes]
    choices = {}
    for spec in specs:
        asked = dataclasses.replace(request or SelectionRequest(), structured_output_spec=spec)
        choices[spec.describe()] = next((c.registration.name for c in registry.candidates(STRUCTURED_OUTPUT, asked)
                                         if c.usable), None)
    return choices


def quantizer_table(quantizers: list[dict]) -> Table:
    """What a user picks a quantizer by: its storage dtype, granularity, error bound,
    and whether `cache.kv_cache_dtype` may name it (per_token and static-scale ones)."""
    table = Table("quantizer", "storage dtype", "granularity", "error bound", "KV-capable", title="quantizers",
                  title_justify="left")
    for item in quantizers:
        capabilities = item["capabilities"]  # a plugin may override capabilities(): show what is there
        bound = capabilities.get("error_bound")
        table.add_row(*map(escape, (item["name"], str(capabilities.get("storage_dtype", "?")),
                                    str(capabilities.get("granularity", "?")),
                                    f"{bound:.3g}" if isinstance(bound, float) else str(bound))),
                      "yes" if capabilities.get("kv_capable", capabilities.get("granularity") == PER_TOKEN) else "no")
    return table


def run(args: argparse.Namespace) -> int:
    loaded = config_from_args(args)
    # the load errors are part of this command's output: logging them as well would print each twice
    registry = registry_from_config(loaded, log_errors=False)
    request = selection_request(loaded.config, registry) if args.explain else None
    data = report(registry, request, args.explain)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print_report(data, Console())
    return 0


def print_report(data: dict, console: Console) -> None:
    """The report as tables: one per kind, so no column has to fit the longest kind
    name, and every name stays whole at 80 columns (long cells wrap, never get cut).
    Every text a plugin supplies goes through `escape`: rich would take `kvforge[triton]`
    in a reason for a markup tag and print `kvforge`."""
    console.print(f"[bold]kvforge plugins[/bold] (API {data['api_version'][0]}.{data['api_version'][1]})")
    for kind in KINDS:
        items = [item for item in data["implementations"] if item["kind"] == kind]
        if not items:
            console.print(f"{kind}: none registered")
            continue
        table = Table(title=kind, title_justify="left")
        # names are what config fields take: never wrapped or cut; the other cells wrap
        table.add_column("name", no_wrap=True, min_width=max(len(item["name"]) for item in items))
        table.add_column("package", overflow="fold")
        table.add_column("API", no_wrap=True)
        table.add_column("available", overflow="fold")
        for item in items:
            status = "yes" if item["available"] else f"no: {item['reason']}"
            table.add_row(escape(item["name"]), escape(f"{item['distribution']} {item['version']}"),
                          ".".join(map(str, item["api_version"])), escape(status))
        console.print(table)
    quantizers = [item for item in data["implementations"] if item["kind"] == QUANTIZER]
    if quantizers:
        console.print(quantizer_table(quantizers))
    if data["errors"]:
        errors = Table(title="plugin load errors", title_justify="left")
        errors.add_column("plugin", no_wrap=True, min_width=max(len(error["plugin"]) for error in data["errors"]))
        for header in ("package", "stage", "error"):
            errors.add_column(header, overflow="fold")
        for error in data["errors"]:
            errors.add_row(*map(escape, (error["plugin"], f"{error['distribution']} {error['version']}",
                                         error["stage"], error["message"])))
        console.print(errors)
    if data["skipped_plugins"]:
        console.print(f"skipped by allow/deny: {escape(', '.join(data['skipped_plugins']))}")
    for kind, verdict in data.get("explain", {}).items():
        if not verdict["candidates"]:
            console.print(f"[bold]{kind}[/bold]: none registered")
            continue
        console.print(f"[bold]{kind}[/bold]: auto picks {escape(verdict['chosen'] or 'nothing usable')}")
        if "by_spec" in verdict:
            console.print(escape("  per request, by its spec: " + ", ".join(
                f"{spec} -> {name or 'nothing usable'}" for spec, name in verdict["by_spec"].items())))
        for candidate in verdict["candidates"]:
            if candidate["name"] != verdict["chosen"]:
                console.print(escape(f"  skipped {candidate['name']}: {candidate['why_not'] or 'lower priority'}"))
