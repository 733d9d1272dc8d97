"""The vLLM importance-sampling path without vLLM: TRL's own generation, reported with sampler log-probs that
differ from the trainer's (as vLLM's do), so TRL runs its IS correction (configure it with
``support.configs.simulated_vllm_config``)."""

# TRL's `sampling/*` metrics of the IS correction.
SAMPLING_KEYS = [
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
]


class SimulatedVLLM:
    """Put before GRPOTrainer or DPPOTrainer: the trainer reads as one that generates with vLLM (``use_vllm``, set
    once it is built), and generates with TRL's own ``generate``, reporting sampler log-probs near the tiny model's
    (about log(1/vocab)), deterministic in the tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm = True

    def _generate(self, prompts):
        self.use_vllm = False
        try:
            out = list(super()._generate(prompts))
        finally:
            self.use_vllm = True
        out[4] = [[-4.6 + 0.1 * ((t * 31 + i) % 7 - 3) for i, t in enumerate(ids)] for ids in out[1]]
        return tuple(out)
