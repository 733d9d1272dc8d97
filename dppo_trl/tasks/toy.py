"""An offline toy task for demos and tests: a character-level tokenizer, a tiny random-init Qwen2, and
two-digit addition (``"47+38="`` -> ``"85"``) with an exact-answer reward. Nothing here touches the Hub."""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """Character-level fast tokenizer over ``string.printable`` plus ChatML specials (left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, moe: bool = False, max_positions: int = 256
):
    """A random-init Qwen2 causal LM sized for a CPU test (tied embeddings, fp32, sdpa attention); ``moe``: a
    Qwen3-MoE of the same size instead (4 experts, 2 per token, the router loss coefficient of the real configs)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if moe:
        config = Qwen3MoeConfig(**common, head_dim=hidden_size // 4, moe_intermediate_size=hidden_size, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, router_aux_loss_coef=0.001)
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    return model


def save_tiny_model(
    directory: str | Path, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, moe: bool = False
) -> str:
    """Build and save a tiny model and its tokenizer to ``directory``; return the path (load it like a hub id)."""
    directory = str(directory)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size, num_layers, seed, moe)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def addition_pairs(seed: int = 0, holdout_fraction: float = 0.1):
    """All two-digit sums ``a+b`` split at random into (train, held-out) lists of ``(a, b)``."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    cut = int(len(pairs) * holdout_fraction)
    return pairs[cut:], pairs[:cut]


def addition_dataset(pairs):
    """A ``datasets.Dataset`` of plain-text prompts ``"a+b="`` with the answer column used by the reward."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion, stripped, is exactly the answer; else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def supervised_steps(model, tokenizer, examples, steps: int, batch_size: int = 256, lr: float = 1e-3, seed: int = 0):
    """Plain next-token training on ``prompt + answer + eos`` for ``(prompt, answer)`` examples drawn at random
    (loss on the answer and eos only); returns the last step's loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    eos = tokenizer.eos_token
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        enc = tokenizer([p + a + eos for p, a in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(model.device)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for i, (p, _) in enumerate(batch):
            pad = int((enc["attention_mask"][i] == 0).sum())
            labels[i, : pad + len(p)] = -100
        loss = model(**enc, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return float(loss.detach())


def supervised_warm_start(
    model, tokenizer, pairs, steps: int = 200, batch_size: int = 256, lr: float = 1e-3, seed: int = 0
):
    """Plain next-token training on ``"a+b=" + answer + eos`` (loss on the answer only)."""
    supervised_steps(model, tokenizer, [(f"{a}+{b}=", str(a + b)) for a, b in pairs], steps, batch_size, lr, seed)
    return model


@torch.no_grad()
def answers_correct(
    model, tokenizer, prompts, answers, greedy: bool = True, max_new_tokens: int = 4, batch_size: int = 256
) -> list[bool]:
    """Per prompt: whether its completion (greedy, or sampled at temperature 1), stripped, is exactly its answer."""
    correct = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=1.0 if not greedy else None,
            top_p=None,
            top_k=None,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1) :], skip_special_tokens=True)
        correct += [t.strip() == a for t, a in zip(texts, answers[i : i + batch_size])]
    return correct


def sampled_accuracy(model, tokenizer, pairs, greedy: bool = True, max_new_tokens: int = 4, limit: int = 200) -> float:
    """Fraction of ``pairs`` answered exactly (greedy or sampled at temperature 1)."""
    pairs = pairs[:limit]
    prompts, answers = [f"{a}+{b}=" for a, b in pairs], [str(a + b) for a, b in pairs]
    correct = answers_correct(model, tokenizer, prompts, answers, greedy, max_new_tokens, batch_size=max(len(pairs), 1))
    return sum(correct) / max(len(pairs), 1)
