# A few DPPO steps on a CPU, offline: python examples/quickstart.py
import random
import tempfile

from datasets import Dataset

from dppo_trl import DPPOConfig, DPPOTrainer, smollm2
from dppo_trl.tasks.toy import save_tiny_model

# SmolLM2-135M-Instruct where `dppo-trl-smollm2` has converted it, else a tiny random model built here.
model = smollm2.default_dir()
if not smollm2.is_converted(model):
    print(f"No SmolLM2 in {model} (`dppo-trl-smollm2` converts it): a tiny random model, whose rewards mean nothing.")
    model = save_tiny_model(tempfile.mkdtemp(prefix="dppo-tiny-model-"))

rng = random.Random(0)
pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(64)]
dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def correct_sum(completions, answer, **kwargs):
    """1.0 for a completion that starts with the sum, 0.1 for one that starts with another number, else 0.0.
    The dataset's `answer` column arrives by name."""
    scores = []
    for text, sum_ in zip(completions, answer):
        text = text.strip()
        scores.append(1.0 if text.startswith(sum_) else 0.1 if text[:1].isdigit() else 0.0)
    return scores


args = DPPOConfig(
    output_dir=tempfile.mkdtemp(prefix="dppo-quickstart-"),
    completion_keep_rate=0.5,  # DPPO: train on about half of the completions, reweighted so nothing is biased
    num_generations=4,
    per_device_train_batch_size=8,  # 2 prompts x 4 completions
    max_completion_length=8,
    max_steps=4,
    logging_steps=1,
    report_to="none",
    bf16=False,  # on a CPU; GRPOConfig's bf16=True default needs a GPU
    use_cpu=True,
)
trainer = DPPOTrainer(model=str(model), reward_funcs=correct_sum, args=args, train_dataset=dataset)
trainer.train()
