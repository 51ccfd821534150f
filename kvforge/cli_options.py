"""Options shared by every sub-command that builds a configuration."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from kvforge.core import LoadedConfig, Registry, build_registry, load_config


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable), e.g. --set cache.block_size=32")


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size`, `--pipeline-parallel-size` and `--executor`: shorthands
    for the `parallel` settings, read back by `parallel_overrides`."""
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N",
                        help="split the model over N ranks (parallel.tensor_parallel_size; N - 1 workers)")
    parser.add_argument("--pipeline-parallel-size", type=int, metavar="N",
                        help="split the model's layers into N stages (parallel.pipeline_parallel_size)")
    parser.add_argument("--executor", metavar="NAME",
                        help="what runs the workers (parallel.executor): mp (processes on this host), ray (Ray "
                             "actors), torchrun (the processes torchrun started); default auto")


def parallel_overrides(args: argparse.Namespace) -> list[str]:
    """`args.overrides` (`--set`) followed by the parallel shorthands that were given."""
    overrides = list(args.overrides)
    if args.tensor_parallel_size is not None:
        overrides.append(f"parallel.tensor_parallel_size={args.tensor_parallel_size}")
    if args.pipeline_parallel_size is not None:
        overrides.append(f"parallel.pipeline_parallel_size={args.pipeline_parallel_size}")
    if args.executor is not None:
        overrides.append(f"parallel.executor={json.dumps(args.executor)}")
    return overrides


def add_batch_invariant_option(parser: argparse.ArgumentParser) -> None:
    """`--batch-invariant`: the shorthand for `batch_invariant = true`, read back by
    `batch_invariant_overrides`."""
    parser.add_argument("--batch-invariant", action="store_true",
                        help="each request's tokens and logprobs bitwise the same alone or in any batch "
                             "(batch_invariant; vLLM's VLLM_BATCH_INVARIANT=1); costs some throughput")


def batch_invariant_overrides(args: argparse.Namespace) -> list[str]:
    """`batch_invariant=true` when `--batch-invariant` was given (`--set` form)."""
    return ["batch_invariant=true"] if args.batch_invariant else []


def add_lora_options(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags: shorthands for the `lora` settings (read back by
    `lora_overrides`) and the adapters to serve (`lora_modules`)."""
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters beside the base model (lora.enabled; implied by the other LoRA "
                             "flags)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters to serve from the start, each NAME=PATH (a PEFT directory) or vLLM's "
                             "JSON form '{\"name\": NAME, \"path\": PATH, \"base_model_name\": MODEL}'; "
                             "requests pick one with model=NAME")
    parser.add_argument("--max-loras", type=int, metavar="N",
                        help="most distinct adapters in one batch (lora.max_loras; default 1)")
    parser.add_argument("--max-lora-rank", type=int, metavar="R",
                        help="largest adapter rank accepted (lora.max_lora_rank; default 16)")
    parser.add_argument("--max-cpu-loras", type=int, metavar="N",
                        help="adapters kept loaded in memory, at least --max-loras (lora.max_cpu_loras; default "
                             "--max-loras)")
    parser.add_argument("--enable-lora-updates", action="store_true",
                        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING): whoever reaches the server can then make it read "
                             "any directory it can")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_modules(args: argparse.Namespace) -> list[LoRAModule]:
    """The `--lora-modules` entries; `ValueError` naming the bad one and the forms accepted."""
    modules = []
    for text in args.lora_modules:
        forms = "give NAME=PATH or '{\"name\": NAME, \"path\": PATH}'"
        if text.lstrip().startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {text!r} is not valid JSON ({exc}); {forms}") from None
            unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else set()
            if not isinstance(entry, dict) or unknown or not all(isinstance(entry.get(k), str) and entry[k]
                                                                 for k in ("name", "path")):
                raise ValueError(f"--lora-modules {text!r}: a JSON entry needs the strings name and path (and may "
                                 f"give base_model_name){f', not {sorted(unknown)}' if unknown else ''}; {forms}")
            modules.append(LoRAModule(entry["name"], entry["path"], entry.get("base_model_name")))
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r} is not NAME=PATH; {forms}")
        modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {repeated} more than once; give each adapter its own name")
    return modules


def lora_overrides(args: argparse.Namespace) -> list[str]:
    """The `lora` settings the LoRA flags give (`--set` form)."""
    overrides = []
    for flag, key in (("max_loras", "max_loras"), ("max_lora_rank", "max_lora_rank"),
                      ("max_cpu_loras", "max_cpu_loras")):
        if getattr(args, flag) is not None:
            overrides.append(f"lora.{key}={getattr(args, flag)}")
    if args.enable_lora or args.lora_modules or args.enable_lora_updates:
        overrides.append("lora.enabled=true")
    return overrides


def config_from_args(args: argparse.Namespace) -> LoadedConfig:
    return load_config(config_file=args.config, overrides=args.overrides)


def registry_from_config(loaded: LoadedConfig, log_errors: bool = True) -> Registry:
    """The registry the configuration's `plugins` section asks for; `log_errors=False`
    for a command that shows the load errors itself."""
    plugins = loaded.config.plugins
    return build_registry(allow=plugins.allow, deny=plugins.deny, strict=plugins.strict, log_errors=log_errors)
