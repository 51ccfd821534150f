"""Options shared by every sub-command that builds a configuration."""

from __future__ import annotations

import argparse

from kvforge.core import LoadedConfig, Registry, build_registry, load_config


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable), e.g. --set cache.block_size=32")


def config_from_args(args: argparse.Namespace) -> LoadedConfig:
    return load_config(config_file=args.config, overrides=args.overrides)


def registry_from_config(loaded: LoadedConfig, log_errors: bool = True) -> Registry:
    """The registry the configuration's `plugins` section asks for; `log_errors=False`
    for a command that shows the load errors itself."""
    plugins = loaded.config.plugins
    return build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict, log_errors=log_errors)
