"""Functional Llama-family models (llama and qwen2 architectures): configs, params, forward
building blocks, and loaders for GGUF files and Hugging Face checkpoints (``load``)."""
from .configs import (ModelConfig, RopeScaling, get_config, llama3_1_8b, llama3_8b, qwen2_5_1_5b,
                      smollm2_135m, tiny, with_indexer)
from .llama import (apply_rope, attention_inputs, dense_attend, embed, final_logits,
                    forward, gqa_attention, indexer_inputs, init_params, layer_output,
                    num_params, param_shapes, rms_norm)
from .loader import load, resolve_model

__all__ = [
    "ModelConfig", "RopeScaling", "get_config", "tiny", "smollm2_135m", "qwen2_5_1_5b",
    "llama3_8b", "llama3_1_8b", "load", "resolve_model",
    "with_indexer", "init_params", "param_shapes", "num_params", "embed", "attention_inputs",
    "indexer_inputs", "layer_output", "final_logits", "forward", "dense_attend",
    "gqa_attention", "apply_rope", "rms_norm",
]
