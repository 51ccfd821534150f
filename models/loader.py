"""Load a model from a local Hugging Face directory or a built-in name.

Weights come through safetensors only (`model.safetensors` or a sharded
`model.safetensors.index.json`); pickled checkpoints are refused. Every
parameter must be present with the right shape and no tensor may be left over:
the error names the tensor.
"""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvforge.core import FLOAT_DTYPES, AttentionBackend, AttentionLayerSpec, Quantizer, dtype_name
from kvforge.core.errors import ConfigError, UnsupportedConfigurationError

from .base import CausalLM, ModelConfig
from .cpp_decoder_stack import attach_decoder_stack
from .cpp_linear import cpp_linear_pays, cpp_linear_unavailable, use_cpp_linears
from .cpp_norms import cpp_norms_unavailable, use_cpp_norms
from .heap import release_free_memory
from .lora_layers import enable_lora
from .meta_build import on_meta
from .packed_linear import (AUTO_MIN_WEIGHT, LINEAR_KERNELS, linear_weight, onednn_unavailable, pack_linears,
                            replace_linears)
from .quantized_linear import Int8Linear, check_int8_linears, int8_replacement, place_on_huge_pages, quantize_linears
from .registry import model_class
from .weight_slices import ModelShard, WeightSlice

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_MODELS = ("kvforge-tiny", "kvforge-tiny-draft")
log = logging.getLogger(__name__)


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """The directory of a built-in model name or a local path."""
    if str(name_or_path) in BUILTIN_MODELS:
        return BUILTIN_DIR / str(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        close = difflib.get_close_matches(str(name_or_path), BUILTIN_MODELS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close and not path.exists() else ""
        raise ConfigError(
            f"model {str(name_or_path)!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a local "
            f"directory with a config.json{hint} Give a built-in name or a Hugging Face model directory "
            "(downloads are not supported)")
    return path


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig(json.loads((model_dir / "config.json").read_text()))


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """`dtype` itself, or for "auto"/None the checkpoint's dtype (float32 when it names none)."""
    if dtype in (None, "auto"):
        dtype = config.value("dtype", config.value("torch_dtype", "float32"))
    if isinstance(dtype, str):
        dtype = FLOAT_DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in FLOAT_DTYPES.values():
        raise ConfigError(f"model dtype {dtype} is not supported; choose one of: auto, {', '.join(FLOAT_DTYPES)}")
    return dtype


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights, or an error saying what is there instead."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return files
    pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {', '.join(pickled)}; kvforge loads safetensors only, never pickle: convert them " \
           "with transformers' save_pretrained(safe_serialization=True))" if pickled else ""
    raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {model_dir}{hint}")


def load_weights(model: CausalLM, files: list[Path], dtype: torch.dtype, device: torch.device,
                 slices: dict[str, WeightSlice] | None = None, parts: list[str] = (), on_part=None) -> int:
    """Copy every checkpoint tensor into the parameter of the same name, strictly; only
    its `slices[name]` part where one is given (reading only that part of the file).
    `on_part(name)` is called for each of `parts` (names of modules of `model`) as
    soon as the last of its tensors is in, so it may replace the module's weights
    while the others are still being read. Returns the bytes read from the files
    (as stored, before the cast to `dtype`)."""
    params = dict(model.named_parameters())
    slices = slices or {}
    seen: set[str] = set()
    read = 0
    parts_left = _parts_left(parts, params)
    for file in files:
        with _open_checkpoint(file) as reader:
            keys = list(reader.keys())
        for key in keys:
            name = model.checkpoint_name(key)
            if name.endswith(tuple("." + s for s in model.ignored_suffixes)) or (name in model.tied_keys and name not in params):
                continue
            if name not in params:
                raise ConfigError(
                    f"unexpected tensor {key!r} in {file.name}: {type(model).__name__} has no parameter "
                    f"{name!r}; is config.json's architecture right for this checkpoint?")
            # Each tensor through a mapping of its own: the pages a read touches stay resident
            # while the file is mapped, so one mapping kept over the file would add the whole
            # checkpoint to the process's peak beside the copies made of it.
            with _open_checkpoint(file) as reader:
                source = reader.get_slice(key)
                shape = tuple(source.get_shape())
                if shape != tuple(params[name].shape):
                    raise ConfigError(
                        f"tensor {key!r} in {file.name} has shape {shape}, but the model built "
                        f"from config.json expects {tuple(params[name].shape)}")
                part = slices.get(name)
                seen.add(name)
                if part is not None and part.skipped:
                    continue
                tensor = reader.get_tensor(key) if part is None else part.cut(source)
                read += tensor.numel() * tensor.element_size()
                # copy=True: a tensor safetensors read in place (zero-copy) would keep the file mapped
                tensor = tensor.to(device=device, dtype=dtype, copy=True)
            _warn_if_not_finite(tensor, key, file)
            _assign(model, name, tensor)
            del tensor
            part, left = parts_left.pop(name, (None, None))
            if part is not None:
                left.discard(name)
                if not left:
                    on_part(part)
    missing = sorted(set(params) - seen)
    if missing:
        raise ConfigError(f"checkpoint has no tensor {missing[0]!r}" +
                          (f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}...)" if len(missing) > 1 else "")
                          + f"; the files read were {', '.join(f.name for f in files)}")
    return read


def _parts_left(parts: list[str], params: dict[str, nn.Parameter]) -> dict[str, tuple[str, set[str]]]:
    """Each parameter under a module named in `parts`, by name, to that module's name
    and the set (one per part, shared) of the part's parameters not read yet."""
    left = {}
    for part in parts:
        names = {name for name in params if name.startswith(part + ".")}
        left.update((name, (part, names)) for name in names)
    return left


def _warn_if_not_finite(tensor: torch.Tensor, key: str, file: Path) -> None:
    """Warn about NaN or infinity in a loaded weight (checked after the cast, so an
    overflow of the model dtype shows too): the model would still load and run, and
    only the requests those values reach would fail."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor)  # NaN in either if anywhere; no tensor-sized temporary
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        log.warning("tensor %r in %s holds %d non-finite values (NaN or infinity) as %s; requests whose logits "
                    "they reach end with finish_reason 'error'", key, file, bad, dtype_name(tensor.dtype))


def _open_checkpoint(file: Path):
    """`safe_open` on one checkpoint file, with a damaged file (truncated download,
    interrupted save) named as such instead of safetensors' bare header error."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise ConfigError(f"checkpoint file {file} is damaged and cannot be read ({exc}); it is probably truncated "
                          "(an interrupted download or save): download or save it again") from exc


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


def attention_specs(name_or_path: str | Path) -> list[AttentionLayerSpec]:
    """Each layer's attention spec, read without loading weights; for choosing a
    backend before `load_model` (sliding windows show up in `required_features()`)."""
    config = load_config(resolve_model_dir(name_or_path))
    with on_meta():
        return list(model_class(config.get("architectures") or [])(config).layer_specs)


def load_model(name_or_path: str | Path, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               attention_backend: type[AttentionBackend] | None = None, linear_kernel: str = "auto",
               kv_quantizer: Quantizer | None = None, weight_quantizer: Quantizer | None = None,
               quantize_lm_head: bool = True, shard: ModelShard | None = None,
               weight_activations: str = "none", lora=None) -> CausalLM:
    """Build and load a model; attention runs through instances of `attention_backend`.

    `name_or_path` is a built-in name (`kvforge-tiny`, `kvforge-tiny-draft`) or a
    local Hugging Face directory. `dtype` is float32, bfloat16, float16 or "auto".
    `linear_kernel` is "torch" (`F.linear`), "onednn" (weights packed once, see
    `packed_linear`; an error where unavailable), "cpp" (kvforge's C++ kernels,
    bfloat16 and float32 CPU models, see `cpp_linear`) or "auto": cpp where
    `cpp_linear.cpp_linear_pays` says it measured fastest for the model's dtype,
    else onednn where available, for weights of at least `AUTO_MIN_WEIGHT`
    elements, where packing pays.
    "cpp", and "auto" for float32 and bfloat16 CPU models, also run RMSNorm and
    rotary through kvforge's C++ kernels (`cpp_norms`).
    `kv_quantizer` (a `per_token` Quantizer instance) stores the KV cache quantized;
    `attention_backend` must then read its storage dtype (see `CausalLM.set_kv_quantizer`).
    `weight_quantizer` (a per_channel int8 `Quantizer`, e.g. the registry's
    `int8_weight`) turns every linear layer, and an untied LM head unless
    `quantize_lm_head` is False, into an int8 `Int8Linear` (see
    `quantized_linear`); `linear_kernel` then applies to the layers left in float.
    `shard` (tensor or pipeline parallelism: keep this rank's part, see
    `kvforge.distributed` and `weight_slices`) says which slice of each tensor to
    read, and turns the float model into its shard once they are in, before
    quantization and packing; `model.checkpoint_bytes_read` then says how much of
    the checkpoint this rank read.
    `weight_activations` is how those layers treat their input: "none" keeps it
    float (weight-only), "int8" quantizes it per row (W8A8, CPU).
    `lora` (the engine's `LoRAConfig`, or anything with `max_loras` and
    `max_lora_rank`; None or `enabled` False: no LoRA) wraps the layers adapters
    may change before they are quantized or packed (`lora_layers.enable_lora`;
    the slots are then `model.lora`); with a `shard`, adapters are cut as its
    weights are (`shard.lora_slices`).
    """
    model_dir = resolve_model_dir(name_or_path)
    config = load_config(model_dir)
    cls = model_class(config.get("architectures") or [])
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    with on_meta():  # no memory and no initial values for weights about to be overwritten
        model = cls(config)
    slices = shard.weight_slices(model) if shard is not None else None
    lora_on = lora is not None and getattr(lora, "enabled", True)
    lora_slices = shard.lora_slices(model, slices) if lora_on and shard is not None else None
    # Int8 weights, on a whole model: each block is finished and quantized as soon as it is
    # read, so the float model is never held whole (a shard or LoRA reshapes the float model first).
    early = weight_quantizer is not None and shard is None and not lora_on
    parts, finish = _quantized_as_read(model, weight_quantizer, quantize_lm_head, weight_activations) if early \
        else ((), None)
    model.checkpoint_bytes_read = load_weights(model, checkpoint_files(model_dir), dtype, device, slices, parts, finish)
    model.finish_loading()
    model.eval()
    if shard is not None:
        shard.apply(model)
    if lora_on:
        enable_lora(model, max_loras=lora.max_loras, max_rank=lora.max_lora_rank, shard_slices=lora_slices)
    if weight_quantizer is not None:  # placed on 2 MiB pages once, after the kernels have fused what they fuse
        quantize_linears(model, weight_quantizer, lm_head=quantize_lm_head, activations=weight_activations, place=False)
    use_linear_kernel(model, linear_kernel)
    place_on_huge_pages([m for m in model.modules() if isinstance(m, Int8Linear)])
    model.set_kv_quantizer(kv_quantizer)
    if attention_backend is not None:
        model.set_attention_backend(attention_backend)
    attach_decoder_stack(model, sharded=shard is not None)
    return model


def _quantized_as_read(model: CausalLM, quantizer: Quantizer, lm_head: bool, activations: str):
    """For `load_weights`: the modules to quantize as soon as they are read (each
    block, and an untied head unless `lm_head` is False), by name, and what to do
    with each: finish a block (`finish_block`) and turn its float linear layers
    into Int8Linear layers, or the head into one, as `quantize_linears` does. Only
    names are kept: a replaced layer is freed at once."""
    check_int8_linears(quantizer, activations)  # before reading anything
    replacement = int8_replacement(model, quantizer, lm_head, activations)
    head = model.lm_head_weight()  # an untied head is a linear layer of its own; a tied one is the embedding
    heads = [name for name, module in model.named_modules()
             if lm_head and head is not None and linear_weight(module) is not None and module.weight is head]
    del head

    def finish(name: str) -> None:
        if name in heads:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, attr, replacement(getattr(owner, attr)))
            release_free_memory()
        else:
            block = model.get_submodule(name)
            model.finish_block(block)
            replace_linears(block, replacement)

    return [prefix for prefix, _ in model.blocks()] + heads, finish


def use_linear_kernel(model: CausalLM, kernel: str) -> None:
    """Run `model`'s linear layers with `kernel` (see `load_model`)."""
    if kernel not in LINEAR_KERNELS:
        raise ConfigError(f"unknown linear kernel {kernel!r}; choose from: {', '.join(LINEAR_KERNELS)}")
    if kernel == "torch":
        return
    if kernel == "cpp" or (kernel == "auto" and cpp_linear_pays(model.dtype, model.device)):
        why_not = cpp_linear_unavailable(model.dtype, model.device)
        if why_not is not None:
            raise UnsupportedConfigurationError(f"linear kernel 'cpp' is unavailable: {why_not}; "
                                                "use linear_kernel 'torch', 'onednn' or 'auto'")
        use_cpp_linears(model)
        use_cpp_norms(model)
        return
    why_not = onednn_unavailable(model.dtype, model.device)
    if why_not is None:
        pack_linears(model, min_weight=AUTO_MIN_WEIGHT if kernel == "auto" else 0)
    elif kernel == "onednn":
        raise UnsupportedConfigurationError(f"linear kernel 'onednn' is unavailable: {why_not}; "
                                            "use linear_kernel 'torch' or 'auto'")
    if kernel == "auto" and cpp_norms_unavailable(model.dtype, model.device) is None:
        try:
            use_cpp_norms(model)
        except UnsupportedConfigurationError as exc:  # the compiler is there but the build failed
            log.warning("RMSNorm and rotary stay on torch: %s", exc)
