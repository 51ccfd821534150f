"""A PEFT LoRA adapter read from its directory, checked against the model it will run on.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`,
whose tensors are named `base_model.model.<module>.lora_A.weight` (`[r, in]`)
and `...lora_B.weight` (`[out, r]`), with `<module>` the layer's name in the
Hugging Face model. GPT-2's `Conv1D` layers (`fan_in_fan_out` in the config)
store their adapters the same way round: PEFT applies `lora_B(lora_A(x))` to the
input either way. Nothing of peft is imported: the files are read as they are.

What is refused, with the field and value named (`LoRAAdapterError`): a
`peft_type` other than LORA, DoRA, trained biases, embedding or LM-head targets
(`modules_to_save`, `embed_tokens`, `lm_head`, `wte`), a rank above the model's
`max_rank`, a target module the model does not have, tensors whose shapes do
not fit the model, and missing files.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from kvforge.core.errors import ConfigError

from .lora_layers import LORA_LAYER_NAMES, lora_targets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
# Modules an adapter may not change here: a slot holds low-rank updates of linear layers only.
EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "wpe")
LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")


class LoRAAdapterError(ConfigError):
    """A LoRA adapter cannot run on this model; the message names the file, field or tensor."""


@dataclass(frozen=True, eq=False)  # two reads are told apart by `fingerprint`, not by comparing tensors
class LoRAAdapter:
    """One PEFT LoRA adapter in host memory, checked against a model.

    `rank` is the largest rank of its layers (`r`, or above it by `rank_pattern`);
    `scale` is `alpha / r` (`alpha / sqrt(r)` with `use_rslora`). `weights` maps
    the model's checkpoint layer names (`model.layers.3.self_attn.q_proj`,
    `transformer.h.0.attn.c_attn`) to float32 `(A [r, in], B [out, r])`; a layer
    whose `alpha_pattern` or `rank_pattern` gives it another scale has B
    multiplied by its scale over `scale`, so `scale` applies to every layer.
    `fingerprint` is the sha256 of the config's and the weights' bytes: other
    weights under the same name get another one."""

    path: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str
    base_model: str | None


def load_peft_adapter(path: str | Path, model, *, max_rank: int) -> LoRAAdapter:
    """Read the PEFT LoRA adapter in directory `path` for `model` (a loaded `CausalLM`,
    LoRA-enabled or not), refusing what it cannot run (see the module docstring)."""
    path = Path(path)
    config_bytes, weights_bytes = _read(path, CONFIG_FILE), _read(path, WEIGHTS_FILE)
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"{path / CONFIG_FILE} is not valid JSON ({exc})") from exc
    _check_config(path, config)
    try:
        tensors = load_safetensors(weights_bytes)
    except SafetensorError as exc:
        raise LoRAAdapterError(f"{path / WEIGHTS_FILE} is damaged and cannot be read ({exc})") from exc
    r, alpha, rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    scale = _scale(alpha, r, rslora)
    targets = lora_targets(model)
    pairs = _pairs(path, tensors, model)
    _check_target_modules(path, config, targets)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ranks = []
    state = getattr(model, "lora", None)
    elsewhere = 0  # layers of another pipeline stage
    for module, (name, a, b) in sorted(pairs.items()):
        if state is not None:  # a tensor- or pipeline-parallel part keeps its cut of A and B, as of the weights
            part = state.local_part(name, a, b)
            if part is None:
                elsewhere += 1
                continue
            a, b = part
        target = targets.get(name)
        if target is None:
            raise LoRAAdapterError(
                f"{path / WEIGHTS_FILE}: {KEY_PREFIX}{module}.lora_A.weight adapts {name!r}, which is not a layer "
                f"of this {type(model).__name__} LoRA can change (those: {_choices(targets)}); was the adapter "
                "trained for another base model?")
        rank = a.shape[0]
        expected = ((rank, target.in_features), (target.out_features, rank))
        for which, tensor, shape in (("A", a, expected[0]), ("B", b, expected[1])):
            if tuple(tensor.shape) != shape:
                raise LoRAAdapterError(
                    f"{path / WEIGHTS_FILE}: tensor {KEY_PREFIX}{module}.lora_{which}.weight has shape "
                    f"{tuple(tensor.shape)}, but this model's {name} expects {shape}; the adapter was trained for "
                    "a base model of other sizes")
        if rank > max_rank:
            field = "rank_pattern" if config.get("rank_pattern") and rank != r else "r"
            raise LoRAAdapterError(
                f"{path / CONFIG_FILE}: {field} = {json.dumps(config.get(field))} gives {name} rank {rank}, above "
                f"max_rank {max_rank}; raise "
                "lora.max_lora_rank to at least that, or use an adapter of lower rank")
        for which, tensor in (("A", a), ("B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: tensor {KEY_PREFIX}{module}.lora_{which}.weight "
                                       "holds NaN or infinity")
        layer_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
        layer_scale = _scale(layer_alpha, rank, rslora)
        b = b.float() if layer_scale == scale else b.float() * (layer_scale / scale)
        weights[name] = (a.float().contiguous(), b.contiguous())
        ranks.append(rank)
    if not weights and not elsewhere:
        raise LoRAAdapterError(f"{path / WEIGHTS_FILE} holds no lora_A/lora_B tensors: nothing to adapt")
    return LoRAAdapter(
        path=str(path), rank=max(ranks), alpha=alpha, scale=scale,
        target_modules=tuple(sorted({name.rpartition(".")[2] for name in weights})), weights=weights,
        fingerprint=hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest(),
        base_model=config.get("base_model_name_or_path"))


def _read(path: Path, name: str) -> bytes:
    file = path / name
    if not file.is_file():
        pickled = " (adapter_model.bin is there: kvforge reads safetensors only, never pickle; save the adapter " \
                  "with save_pretrained(safe_serialization=True))" if (path / "adapter_model.bin").is_file() else ""
        raise LoRAAdapterError(f"LoRA adapter directory {path} has no {name}{pickled}; a PEFT adapter directory "
                               f"holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    return file.read_bytes()


def _check_config(path: Path, config: dict) -> None:
    """Refuse the settings kvforge does not run, naming field and value."""
    where = path / CONFIG_FILE

    def refuse(field: str, why: str) -> None:
        raise LoRAAdapterError(f"{where}: {field} = {json.dumps(config.get(field))} is not supported: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", "kvforge serves LoRA adapters only (peft_type LORA)")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            refuse(field, "it must be a positive number")
    if config.get("use_dora"):
        refuse("use_dora", "DoRA's magnitude vectors are not served; use a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        refuse("bias", "trained biases change the base layers; only bias 'none' is served")
    if config.get("lora_bias"):
        refuse("lora_bias", "a bias on lora_B is not served")
    if config.get("modules_to_save"):
        refuse("modules_to_save", "whole trained copies of modules (often the embedding or LM head) are not served; "
                                  "only low-rank updates of linear layers")
    for field in ("layer_replication", "target_parameters"):
        if config.get(field):
            refuse(field, "kvforge serves adapters of the base model's linear modules only")


def _check_target_modules(path: Path, config: dict, targets) -> None:
    """`target_modules` must name layers the model has (PEFT's rules: a list entry
    matches a module named so or ending in `.entry`; a string is a regular
    expression over the whole module name), none of them an embedding or head."""
    wanted = config.get("target_modules")
    where = path / CONFIG_FILE
    if isinstance(wanted, str):
        for name in EMBEDDING_NAMES:
            if re.fullmatch(wanted, name) or any(re.fullmatch(wanted, f"{p}.{name}") for p in ("model", "transformer")):
                raise LoRAAdapterError(f"{where}: target_modules = {wanted!r} matches the {name} embedding or head, "
                                       "which LoRA cannot change here; target linear layers only")
        if not any(re.fullmatch(wanted, name) for name in targets):
            raise LoRAAdapterError(f"{where}: target_modules = {wanted!r} matches no layer of this model LoRA can "
                                   f"change ({_choices(targets)})")
        return
    for entry in wanted or ():
        if entry.rpartition(".")[2] in EMBEDDING_NAMES:
            raise LoRAAdapterError(f"{where}: target_modules lists {entry!r}: embeddings and the LM head cannot be "
                                   f"changed by LoRA here; target linear layers only ({_choices(targets)})")
        if not any(name == entry or name.endswith("." + entry) for name in targets):
            raise LoRAAdapterError(f"{where}: target_modules lists {entry!r}, which this model does not have; "
                                   f"layers LoRA can change: {_choices(targets)}")


def _pairs(path: Path, tensors: dict[str, torch.Tensor], model) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    """PEFT module name -> (checkpoint layer name, A, B), every tensor accounted for."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = LORA_KEY.fullmatch(key.removeprefix(KEY_PREFIX)) if key.startswith(KEY_PREFIX) else None
        if match is None:
            what = ("an embedding's adapter, which is not served" if "lora_embedding" in key else
                    "a DoRA magnitude vector, which is not served" if "lora_magnitude" in key else
                    f"not a LoRA weight (expected {KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight)")
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: tensor {key!r} is {what}")
        found.setdefault(match["module"], {})[match["which"]] = tensor
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE} has no {KEY_PREFIX}{module}.lora_{missing}.weight for "
                                   f"its lora_{'A' if missing == 'B' else 'B'}; the file is incomplete")
        if module.rpartition(".")[2] in EMBEDDING_NAMES:
            raise LoRAAdapterError(f"{path / WEIGHTS_FILE}: {module} is an embedding or the LM head, which LoRA "
                                   "cannot change here")
        pairs[module] = (model.checkpoint_name(module), ab["A"], ab["B"])
    return pairs


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern that matches the module name's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _choices(targets) -> str:
    names = sorted({name.rpartition(".")[2] for name in targets}, key=LORA_LAYER_NAMES.index)
    return ", ".join(names) or "none"
