"""LoRA in a loaded model: each layer an adapter may change gets slot buffers, and
one step's tokens, each of its own adapter slot, run through one batched update
per layer (Punica / S-LoRA style, as vLLM serves several adapters in one batch).

    state = enable_lora(model, max_loras=4, max_rank=16)   # after finish_loading
    state.load(0, load_peft_adapter(path, model, max_rank=16))
    state.set_step(token_slots)             # int64 [T], -1: the base model
    hidden = model.forward(...)

`enable_lora` wraps every layer LoRA can target (`LORA_LAYER_NAMES`, and Llama's
fused `qkv_proj`, which holds q, k and v as three parts of its output) in a
`LoRALinear`. Its `base` is any linear module, and is packed or quantized later
like any other (`pack_linears`, `quantize_linears`, `use_cpp_linears` replace the
wrapper's `base` child and keep the wrapper). A step without adapters
(`set_step(None)`, or every token of the base) runs each base layer exactly as
without LoRA, fused post-ops included; a step with adapters adds the update
(`kernels.lora_ops.add_lora`) between the GEMM and its post-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvforge.core.errors import ConfigError
from kvforge.kernels.lora_ops import add_lora

from .layers import activation
from .packed_linear import linear_act, linear_add, linear_mul

# The layers LoRA can target, as PEFT names them: Llama's projections and GPT-2's
# Conv1D layers (attention's c_attn and c_proj, the MLP's c_fc and c_proj).
LORA_LAYER_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "c_attn", "c_proj", "c_fc")
# A fused layer the loader made from checkpoint layers, and the parts it holds, in output order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}


@dataclass(frozen=True)
class LoRATarget:
    """Where one checkpoint layer (e.g. `model.layers.3.self_attn.q_proj`) is computed:
    as part `part` of the model's layer `layer`, output features `[out_start,
    out_start + out_features)`, from `in_features` inputs."""

    layer: str
    part: int
    out_start: int
    out_features: int
    in_features: int


def layer_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear module the models use (float, packed, int8,
    or GPT-2's `Conv1D`, whose weight is stored `[in, out]`); None for anything else."""
    if getattr(module, "weight_is_in_by_out", False):
        return tuple(module.weight.shape)
    found = getattr(module, "in_features", None), getattr(module, "out_features", None)
    return None if None in found else found


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """The checkpoint layers of `model` an adapter may change, by checkpoint name; the
    model may be plain, fused (`finish_loading`), LoRA-enabled, packed or quantized, or
    a tensor- or pipeline-parallel part (its features then this rank's: a row-parallel
    layer's `inner`, the one summed over the ranks, is what LoRA wraps; a pipeline
    stage's layers keep their checkpoint numbers, `stage_layers`)."""
    targets: dict[str, LoRATarget] = {}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for name in LORA_LAYER_NAMES:
            child = module._modules.get(name)
            layer = prefix + name
            if child is not None and hasattr(child, "inner") and hasattr(child, "group"):  # RowParallelLinear
                child, layer = child.inner, layer + ".inner"
            features = None if child is None else layer_features(child)
            if features is not None:
                targets[prefix + name] = LoRATarget(layer, 0, 0, features[1], features[0])
        for fused, parts in FUSED_PARTS.items():
            layer = module._modules.get(fused)
            if layer is not None:
                sizes = fused_part_sizes(module, parts)
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                in_features, out_features = layer_features(layer)
                if sum(sizes) != out_features:
                    raise ConfigError(f"{prefix}{fused} has {out_features} output features, but its attention's "
                                      f"heads make {' + '.join(map(str, sizes))}: LoRA cannot tell where its parts "
                                      f"({', '.join(parts)}) lie")
                for i, (part, start, size) in enumerate(zip(parts, starts, sizes)):
                    targets[prefix + part] = LoRATarget(prefix + fused, i, start, size, in_features)
    stage_layers = getattr(model, "stage_layers", None)
    if stage_layers is not None:  # a pipeline stage: local layer j is the checkpoint's stage_layers[j]
        targets = {_checkpoint_numbered(name, stage_layers): target for name, target in targets.items()}
    return targets


def _checkpoint_numbered(name: str, stage_layers: list[int]) -> str:
    """`model.layers.J.rest` with J, a stage's local layer number, as the checkpoint numbers it."""
    head, _, rest = name.partition("layers.")
    number, _, tail = rest.partition(".")
    return f"{head}layers.{stage_layers[int(number)]}.{tail}" if number.isdigit() else name


def fused_part_sizes(attention: nn.Module, parts: tuple[str, ...]) -> list[int]:
    """Output features of each part of a fused layer: q, k and v of a `qkv_proj`, from
    its attention's spec (the heads this model, or this shard, holds)."""
    spec = attention.attn.spec
    sizes = {"q_proj": spec.num_heads * spec.head_size, "k_proj": spec.num_kv_heads * spec.head_size,
             "v_proj": spec.num_kv_heads * spec.head_size}
    return [sizes[part] for part in parts]


@dataclass(frozen=True)
class Segments:
    """Runs of equal slot over a step's rows: `starts` int64 `[G + 1]`, `slots` int64 `[G]`."""

    starts: torch.Tensor
    slots: torch.Tensor


def segments_of(token_slots: torch.Tensor) -> Segments | None:
    """`token_slots`' (a CPU tensor) runs of equal slot; None when no row has an adapter (nothing to add)."""
    slots, counts = torch.unique_consecutive(token_slots, return_counts=True)
    if not bool((slots >= 0).any()):
        return None
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    return Segments(starts, slots)


class LoRALinear(nn.Module):
    """A linear layer (`base`) plus, per token, its adapter slot's low-rank update.

    Each part (q, k or v of a fused layer; the layer itself otherwise) has its own
    A, `a[part]` `[max_loras, max_rank, in]`, and B, `b_of(part)` `[max_loras,
    max_rank, its out features]`, and one `add_lora` per part adds into its output
    columns: no zero blocks are read for the parts a token's update does not touch
    (a block-diagonal B over the fused output would triple the B a decode step
    reads). The packed_linear post-op helpers route through
    `linear_act`, `linear_mul` and `linear_add` here (`routes_post_ops`)."""

    routes_post_ops = True

    def __init__(self, base: nn.Module, state: LoRAState, parts: list[LoRATarget], dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.state = state
        self.parts = parts
        self.in_features, self.out_features = layer_features(base)
        shape = (state.max_loras, state.max_rank)
        zeros = dict(dtype=dtype, device=device)
        self.register_buffer("a", torch.zeros(len(parts), *shape, self.in_features, **zeros), persistent=False)
        for i, part in enumerate(parts):
            self.register_buffer(f"b{i}", torch.zeros(*shape, part.out_features, **zeros), persistent=False)

    def b_of(self, part: int) -> torch.Tensor:
        """Part `part`'s B for every slot, `[max_loras, max_rank, its out features]`."""
        return getattr(self, f"b{part}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self.state.segments(x.shape[0])
        if segments is not None:
            for i, part in enumerate(self.parts):
                out = y if len(self.parts) == 1 else y[:, part.out_start:part.out_start + part.out_features]
                add_lora(out, x, self.a[i], self.b_of(i), segments.starts, segments.slots)
        return y

    # Post-ops: fused into the base GEMM when the step has no adapter, after the update otherwise.

    def linear_act(self, x: torch.Tensor, act: str) -> torch.Tensor:
        if self.state.segments(x.shape[0]) is None:
            return linear_act(self.base, x, act)
        return activation(act)(self(x))

    def linear_mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.state.segments(x.shape[0]) is None:
            return linear_mul(self.base, x, other)
        return self(x).mul_(other)

    def linear_add(self, x: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        if other is None:
            return self(x)
        if self.state.segments(x.shape[0]) is None:
            return linear_add(self.base, x, other)
        return self(x).add_(other)

    def extra_repr(self) -> str:
        return f"parts={len(self.parts)}, max_loras={self.state.max_loras}, max_rank={self.state.max_rank}"


class LoRAState:
    """A model's LoRA slots (`model.lora` once `enable_lora` ran) and the current step's segments.

    `load` copies an adapter into a slot of every wrapped layer; `set_step` says,
    once per step, which slot each token runs with."""

    def __init__(self, max_loras: int, max_rank: int, shard_slices: dict | None = None):
        self.max_loras = max_loras
        self.max_rank = max_rank
        # A tensor- or pipeline-parallel part: checkpoint layer -> (slice of A, slice of B) this rank keeps
        # (None for a side it keeps whole), or None for a layer of another stage.
        self.shard_slices = shard_slices
        self.layers: dict[str, LoRALinear] = {}  # module path -> wrapper
        self.targets: dict[str, LoRATarget] = {}  # checkpoint layer name -> where it is computed
        self._segments: dict[int, Segments | None] = {}  # row count -> that row set's runs

    @torch.no_grad()
    def load(self, slot: int, adapter) -> None:
        """Copy `adapter` (a `LoRAAdapter`) into `slot`: each A and B zero-padded to
        `max_rank`, the adapter's scale folded into B, in the model's dtype; the
        slot's layers the adapter does not target become zeros."""
        from .lora_adapter import LoRAAdapterError  # here: lora_adapter imports this module

        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(f"adapter {adapter.path}: rank {adapter.rank} is above this model's LoRA "
                                   f"max_rank {self.max_rank}; raise lora.max_lora_rank or use a smaller adapter")
        unknown = sorted(set(adapter.weights) - set(self.targets))
        if unknown:
            raise LoRAAdapterError(f"adapter {adapter.path} changes {unknown[0]!r}, which this model has no "
                                   f"LoRA layer for; was it loaded for another model?")
        self.clear(slot)
        for name, (a, b) in adapter.weights.items():
            target = self.targets[name]
            layer = self.layers[target.layer]
            r = a.shape[0]
            expected = ((r, target.in_features), (target.out_features, r))
            if (tuple(a.shape), tuple(b.shape)) != expected:
                raise LoRAAdapterError(f"adapter {adapter.path}: {name}'s A and B have shapes {tuple(a.shape)} and "
                                       f"{tuple(b.shape)}, the model expects {expected[0]} and {expected[1]}")
            layer.a[target.part, slot, :r] = a.to(layer.a.dtype)
            scaled = (b.float() * adapter.scale).t()  # [r, out]: one rounding to the model dtype, after the scale
            part_b = layer.b_of(target.part)
            part_b[slot, :r] = scaled.to(part_b.dtype)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Zero `slot` in every layer: its tokens then run as the base model's."""
        self._check_slot(slot)
        for layer in self.layers.values():
            layer.a[:, slot].zero_()
            for i in range(len(layer.parts)):
                layer.b_of(i)[slot].zero_()

    def local_part(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's part of checkpoint layer `name`'s A `[r, in]` and B `[out, r]`: the
        input columns of a row-parallel layer's A, the output rows of a column-parallel
        layer's B, as the base weight is cut; None for a layer of another pipeline stage."""
        if self.shard_slices is None or name not in self.shard_slices:
            return a, b
        cut = self.shard_slices[name]
        if cut is None:
            return None
        a_slice, b_slice = cut
        return (a if a_slice is None else a_slice.cut(a), b if b_slice is None else b_slice.cut(b))

    def set_step(self, token_slots: torch.Tensor | None, output_rows: torch.Tensor | None = None) -> None:
        """Say which slot each of this step's flat tokens runs with: int64 `[T]`, -1 for
        the base model; None: no adapter in this step (nothing is added, nothing paid).
        `output_rows` are the rows the model's last layer computes past its KV write
        (`CausalLM.plan`'s), whose layers then see those rows' slots. Call it before
        every forward: the runs are computed here, once for every layer."""
        if token_slots is None:
            self._segments = {}
            return
        token_slots = token_slots.to(device="cpu", dtype=torch.int64)  # add_lora's segments live on the CPU
        if token_slots.numel() and not -1 <= int(token_slots.min()) <= int(token_slots.max()) < self.max_loras:
            raise ConfigError(f"token slots run from {int(token_slots.min())} to {int(token_slots.max())}, but this "
                              f"model has LoRA slots 0..{self.max_loras - 1}, and -1 for the base model")
        self._segments = {token_slots.numel(): segments_of(token_slots)}
        if output_rows is not None:
            self._segments[output_rows.numel()] = segments_of(token_slots[output_rows.cpu()])

    def segments(self, rows: int) -> Segments | None:
        """The runs of a layer input of `rows` rows in the current step; None: no adapter."""
        if not self._segments:
            return None
        found = self._segments.get(rows, False)
        if found is False:
            raise ConfigError(f"a LoRA layer got {rows} rows, but set_step described steps of "
                              f"{' or '.join(map(str, self._segments))} rows; call set_step with this step's "
                              "token slots (and output_rows) before the forward")
        return found

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ConfigError(f"LoRA slot {slot} is out of range; this model has slots 0..{self.max_loras - 1}")


def enable_lora(model: nn.Module, *, max_loras: int, max_rank: int, shard_slices: dict | None = None) -> LoRAState:
    """Wrap every layer of a loaded model that LoRA can target in a `LoRALinear`, with
    `max_loras` slots of rank up to `max_rank`, and set `model.lora`. Call it after
    `finish_loading` and before quantizing or packing (`load_model(..., lora=...)`
    does). The model's dtype and device are the buffers'. On a tensor- or
    pipeline-parallel part, `shard_slices` (`LoRAState.shard_slices`) says how
    adapters are cut as its weights were."""
    if getattr(model, "lora", None) is not None:
        raise ConfigError("LoRA is already enabled on this model (model.lora); enable it once")
    for value, field in ((max_loras, "max_loras"), (max_rank, "max_rank")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"LoRA {field} must be a positive integer, got {value!r}")
    _refuse_unwrappable(model)
    state = LoRAState(max_loras, max_rank, shard_slices)
    targets = lora_targets(model)
    by_layer: dict[str, list[LoRATarget]] = {}
    for target in targets.values():
        by_layer.setdefault(target.layer, []).append(target)
    dtype, device = model.dtype, model.device
    for path, parts in by_layer.items():
        owner_path, _, name = path.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        wrapper = LoRALinear(getattr(owner, name), state, sorted(parts, key=lambda p: p.part), dtype, device)
        setattr(owner, name, wrapper)
        state.layers[path] = wrapper
    state.targets = targets
    model.lora = state
    return state


def _refuse_unwrappable(model: nn.Module) -> None:
    """Refuse a model whose layers were already sharded or fused past what LoRA can wrap."""
    for path, module in model.named_modules():
        if getattr(module, "gate_up_proj", None) is not None:
            raise ConfigError(f"{path}'s gate and up projections are already fused into one C++ kernel, where an "
                              "adapter's update cannot reach them: enable LoRA while loading (load_model(..., "
                              "lora=...), which keeps them apart), or load with linear_kernel 'torch' or 'onednn'")
