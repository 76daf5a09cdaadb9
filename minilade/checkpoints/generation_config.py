"""A checkpoint's own generation defaults (generation_config.json beside its safetensors), and how the caller's
options override them.

Hugging Face semantics: do_sample false (or absent) means greedy decoding, and temperature, top_k and top_p
then do not apply; do_sample true samples with temperature (1.0 when absent), top_k (50 when absent, as
transformers' GenerationConfig does) and top_p (1.0). repetition_penalty applies either way. A GGUF file, or a
folder without the file, has no defaults: greedy decoding without penalties.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError, one_line
from ..sampling import SAMPLING_ONLY, SamplingParams, check_field

FILE = "generation_config.json"
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def read_generation_defaults(checkpoint: Path) -> dict[str, Any]:
    """The SamplingParams fields the checkpoint asks for ({} when it has no generation_config.json).
    Raises CheckpointError, one line naming the file, when the file is not JSON or a value is unusable."""
    path = checkpoint / FILE
    if not checkpoint.is_dir() or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON file ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return defaults_from_hf(data)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {one_line(exc)}") from None


def defaults_from_hf(data: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams fields from a generation config's values (see the module's docstring), checked."""
    defaults: dict[str, Any] = {}
    if data.get("do_sample") is True:
        for name, fallback in HF_SAMPLING_DEFAULTS.items():
            value = data.get(name)
            defaults[name] = fallback if value is None else value
        if defaults["temperature"] == 0:
            raise ValueError("do_sample is true but temperature is 0")
    elif data.get("do_sample") not in (None, False):
        raise ValueError(f"do_sample must be true or false, got {data['do_sample']!r}")
    if data.get("repetition_penalty") is not None:
        defaults["repetition_penalty"] = data["repetition_penalty"]
    if isinstance(defaults.get("top_k"), float) and math.isfinite(defaults["top_k"]) \
            and defaults["top_k"] == int(defaults["top_k"]):
        defaults["top_k"] = int(defaults["top_k"])
    check_sampling(defaults)
    return defaults


def check_sampling(options: Mapping[str, Any]) -> None:
    """A one-line ValueError unless each option is a valid value of its SamplingParams field (sampling.check_field),
    and the options agree with each other once they say whether to sample (a temperature); otherwise the combination
    is checked once the defaults are merged: `--top-k 5` alone may meet a checkpoint that samples."""
    for name, value in options.items():
        check_field(name, value)
    if "temperature" in options:
        SamplingParams(**{name: options[name] for name in ("temperature", *SAMPLING_ONLY) if name in options})


def merge_sampling(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> SamplingParams:
    """The caller's options (None: not given) over the checkpoint's defaults. A caller who asks for greedy
    decoding (temperature 0) drops the checkpoint's sampling-only defaults (top_k, top_p: sampling.SAMPLING_ONLY)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    merged = dict(defaults)
    if chosen.get("temperature") == 0:
        for name in SAMPLING_ONLY:
            merged.pop(name, None)
    merged.update(chosen)
    return SamplingParams(**merged)
