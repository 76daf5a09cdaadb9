"""Every tensor of a LLaMA checkpoint under each name it goes by, in one table.

Each row names one module: its canonical name (Hugging Face LlamaForCausalLM, the names every loader yields),
its GGUF name (llama.cpp), the parameter of minilade/model.py it lands in, its slot in that parameter when several
HF matrices are fused into one (wqkv = q, k, v; w_gate_up = gate, up; concatenated along the output dimension),
and its shape in terms of the ModelConfig. "{i}" stands for the layer index. Every other fact about names --
GGUF <-> canonical mapping, expected shapes, the conversion to our state dict -- is derived from TABLE.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator

import torch

from ..config import ModelConfig
from ..errors import CheckpointError


@dataclass(frozen=True)
class Module:
    """One row of the table: a module with a weight, and a bias where `bias` names a true ModelConfig flag."""

    canonical: str  # "model.layers.{i}.self_attn.q_proj"
    gguf: str  # "blk.{i}.attn_q"
    ours: str  # "layers.{i}.attention.wqkv"
    shape: tuple[str, ...]  # weight shape in named dimensions (see _dims): (out_features, in_features) or (features,)
    slot: int = 0  # position among the modules fused into `ours` along dim 0
    bias: str | None = None  # the ModelConfig flag that gives it a bias: "qkv_bias", "o_bias" or "mlp_bias"
    rotary_heads: str | None = None  # "n_heads" / "n_kv_heads": rows are rotated by RoPE, per head
    tied: bool = False  # absent when config.tie_word_embeddings (the head reuses the embedding matrix)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.canonical


TABLE: tuple[Module, ...] = (
    Module("model.embed_tokens", "token_embd", "tok_embeddings", ("vocab", "dim")),
    Module("model.layers.{i}.input_layernorm", "blk.{i}.attn_norm", "layers.{i}.attention_norm", ("dim",)),
    Module("model.layers.{i}.self_attn.q_proj", "blk.{i}.attn_q", "layers.{i}.attention.wqkv", ("q_dim", "dim"),
           slot=0, bias="qkv_bias", rotary_heads="n_heads"),
    Module("model.layers.{i}.self_attn.k_proj", "blk.{i}.attn_k", "layers.{i}.attention.wqkv", ("kv_dim", "dim"),
           slot=1, bias="qkv_bias", rotary_heads="n_kv_heads"),
    Module("model.layers.{i}.self_attn.v_proj", "blk.{i}.attn_v", "layers.{i}.attention.wqkv", ("kv_dim", "dim"),
           slot=2, bias="qkv_bias"),
    Module("model.layers.{i}.self_attn.o_proj", "blk.{i}.attn_output", "layers.{i}.attention.wo", ("dim", "q_dim"),
           bias="o_bias"),
    Module("model.layers.{i}.post_attention_layernorm", "blk.{i}.ffn_norm", "layers.{i}.ffn_norm", ("dim",)),
    Module("model.layers.{i}.mlp.gate_proj", "blk.{i}.ffn_gate", "layers.{i}.feed_forward.w_gate_up", ("ffn", "dim"),
           slot=0, bias="mlp_bias"),
    Module("model.layers.{i}.mlp.up_proj", "blk.{i}.ffn_up", "layers.{i}.feed_forward.w_gate_up", ("ffn", "dim"),
           slot=1, bias="mlp_bias"),
    Module("model.layers.{i}.mlp.down_proj", "blk.{i}.ffn_down", "layers.{i}.feed_forward.w_down", ("dim", "ffn"),
           bias="mlp_bias"),
    Module("model.norm", "output_norm", "norm", ("dim",)),
    Module("lm_head", "output", "output", ("vocab", "dim"), tied=True),
)
_SUFFIXES = ("weight", "bias")
# Tensors a checkpoint may hold that the model does not load: rotary inverse frequencies (recomputed from the
# config; older transformers saved them per layer) and llama.cpp's rope_freqs (read into the config).
_UNUSED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq|rope_freqs\.weight")
# Fused parameter (template) -> how many modules it holds.
_PARTS = Counter(module.ours for module in TABLE)
# The first index between dots: "blk.3.attn_q.weight" and "model.layers.3.mlp.up_proj.bias" are in layer 3.
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a checkpoint of a given config holds: the row it comes from, its names and its shape."""

    module: Module
    canonical: str  # "model.layers.3.self_attn.q_proj.bias"
    ours: str  # "layers.3.attention.wqkv.bias"
    shape: tuple[int, ...]

    @property
    def parts(self) -> int:
        """How many tensors are concatenated into `ours` (3 for wqkv, 2 for w_gate_up, else 1)."""
        return _PARTS[self.module.ours]


def checkpoint_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Canonical name -> TensorSpec for every tensor a LLaMA checkpoint with this config holds, in forward order
    (embedding, layer 0 .. n_layers-1, final norm, head), so that a loader yields each layer's fused parts
    together. lm_head is absent when tied; biases are present only where the config says."""
    dims = _dims(config)
    tensors: dict[str, TensorSpec] = {}
    for module, layer in _forward_order(config.n_layers):
        if module.tied and config.tie_word_embeddings:
            continue
        weight_shape = tuple(dims[d] for d in module.shape)
        kinds = {"weight": weight_shape}
        if module.bias and getattr(config, module.bias):
            kinds["bias"] = weight_shape[:1]
        for kind, shape in kinds.items():
            spec = TensorSpec(module, _name(module.canonical, layer, kind), _name(module.ours, layer, kind), shape)
            tensors[spec.canonical] = spec
    return tensors


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape (HF orientation: (out_features, in_features)) for a LLaMA model with this
    config; lm_head.weight absent when tied. The contract between the loaders and the model."""
    return {name: tensor.shape for name, tensor in checkpoint_tensors(config).items()}


def unaccounted_tensors(names: Iterable[str], config: ModelConfig) -> list[str]:
    """The stored tensor names (canonical where the format has a mapping) that a model with this config does not
    load and that are not known to be unused: layers past n_layers, biases the config does not enable, unknown
    names. Loading such a checkpoint would run a different model than the file holds. A stored head of a tied
    model is accounted for: transformers ignores it too, tying the head to the embedding."""
    expected = checkpoint_tensors(config)
    tied = {_name(m.canonical, 0, "weight") for m in TABLE if m.tied} if config.tie_word_embeddings else set()
    return [n for n in names if n not in expected and n not in tied and not _UNUSED.fullmatch(n)]


def _dims(config: ModelConfig) -> dict[str, int]:
    """The named dimensions TABLE's shapes use."""
    return {
        "vocab": config.vocab_size,
        "dim": config.dim,
        "q_dim": config.n_heads * config.head_dim,
        "kv_dim": config.n_kv_heads * config.head_dim,
        "ffn": config.intermediate_size,
    }


def _name(template: str, layer: int, kind: str) -> str:
    return f"{template.format(i=layer)}.{kind}"


def _forward_order(n_layers: int) -> Iterator[tuple[Module, int]]:
    """(row, layer index) pairs: the rows before the first layer row, every layer's rows, then the rest."""
    layer_rows = [m for m in TABLE if m.per_layer]
    start = TABLE.index(layer_rows[0])
    yield from ((m, 0) for m in TABLE[:start])
    yield from ((m, i) for i in range(n_layers) for m in layer_rows)
    yield from ((m, 0) for m in TABLE[start + len(layer_rows):])


def _templated(name: str) -> tuple[str, int]:
    """'blk.3.attn_q.weight' -> ('blk.{i}.attn_q.weight', 3); a name outside the layers -> (name, 0)."""
    match = _LAYER_INDEX.search(name)
    if match is None:
        return name, 0
    return f"{name[:match.start()]}.{{i}}.{name[match.end():]}", int(match[1])


def _renaming(source: str, target: str) -> dict[str, str]:
    """Template in one naming (a Module field) -> template in another, for weights and biases."""
    return {f"{getattr(m, source)}.{kind}": f"{getattr(m, target)}.{kind}" for m in TABLE for kind in _SUFFIXES}


_GGUF_TO_CANONICAL = _renaming("gguf", "canonical")
_CANONICAL_TO_GGUF = _renaming("canonical", "gguf")


def canonical_name(name: str) -> str | None:
    """The canonical (Hugging Face) name of a GGUF tensor name, or None for tensors minilade does not load
    (e.g. rope_freqs.weight)."""
    template, layer = _templated(name)
    canonical = _GGUF_TO_CANONICAL.get(template)
    return canonical.format(i=layer) if canonical else None


def gguf_name(name: str) -> str:
    """The GGUF name of a canonical tensor name (the inverse of canonical_name), or the name itself when it has
    none; for error messages."""
    template, layer = _templated(name)
    stored = _CANONICAL_TO_GGUF.get(template)
    return stored.format(i=layer) if stored else name


def layout_flags(names: Collection[str]) -> dict[str, bool]:
    """The ModelConfig flags that a checkpoint's canonical tensor names imply (GGUF metadata does not state them):
    tie_word_embeddings when no head is stored; qkv_bias / o_bias / mlp_bias when layer 0 stores such a bias."""
    flags = {"tie_word_embeddings": not any(_name(m.canonical, 0, "weight") in names for m in TABLE if m.tied)}
    for flag in dict.fromkeys(m.bias for m in TABLE if m.bias):
        flags[flag] = any(_name(m.canonical, 0, "bias") in names for m in TABLE if m.bias == flag)
    return flags


def model_state_dict(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, *,
                     dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Our model's state dict from canonical-named tensors, converted to dtype/device as they arrive.

    A fused parameter is concatenated along dim 0, in slot order, as soon as all its parts have arrived; with
    tensors in checkpoint_tensors' order only one layer's parts wait at a time. Names outside the table for
    this config (e.g. rotary inv_freq buffers, a tied head) are skipped. Raises CheckpointError when a fused
    parameter misses a part.
    """
    table = checkpoint_tensors(config)
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}  # our name -> slot -> tensor
    for name, tensor in tensors:
        entry = table.get(name)
        if entry is None:
            continue
        tensor = tensor.to(device=device, dtype=dtype)
        slots = pending.setdefault(entry.ours, {})
        slots[entry.module.slot] = tensor
        if len(slots) == entry.parts:
            del pending[entry.ours]
            state[entry.ours] = torch.cat([slots[s] for s in range(entry.parts)]) if entry.parts > 1 else tensor
    if pending:
        raise CheckpointError(f"incomplete fused weights: {sorted(pending)[:3]}")
    return state
