"""Functional Llama-family models (configs, params, forward building blocks)."""
from .configs import (ModelConfig, get_config, llama3_8b, qwen2_5_1_5b, smollm2_135m,
                      tiny, with_indexer)
from .llama import (apply_rope, attention_inputs, dense_attend, embed, final_logits,
                    forward, gqa_attention, indexer_inputs, init_params, layer_output,
                    num_params, param_shapes, rms_norm)

__all__ = [
    "ModelConfig", "get_config", "tiny", "smollm2_135m", "qwen2_5_1_5b", "llama3_8b",
    "with_indexer", "init_params", "param_shapes", "num_params", "embed", "attention_inputs",
    "indexer_inputs", "layer_output", "final_logits", "forward", "dense_attend",
    "gqa_attention", "apply_rope", "rms_norm",
]
