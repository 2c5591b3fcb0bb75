"""Tiny Hugging Face causal LMs made here with random weights (nothing is downloaded), for the
converter's tests; needs ``transformers``."""

from __future__ import annotations

import torch
import transformers

VOCAB = 123
# shapes no other test uses: GQA 6 heads / 2 groups, odd vocabulary (padded to 128)
SHAPE = dict(
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
CONFIGS = {
    "llama2": ("LlamaConfig", dict(tie_word_embeddings=False)),
    # Llama 3.1: large base so that wavelengths cross megatron's 2048 / 8192 bands
    "llama31": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    # GPT-2 names its sizes otherwise; one key / value head per query head
    "gpt2": (
        "GPT2Config",
        dict(n_embd=48, n_layer=3, n_head=6, n_inner=40, vocab_size=VOCAB, n_positions=64),
    ),
}
FAMILY = {
    "llama2": "llama",
    "llama31": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gpt2": "gpt2",
}


def make_hf_model(name: str, folder, *, shard: bool = False, **changes):
    """A random ``name`` model saved in ``folder``: every tensor (norm gains and biases too)
    drawn at a scale that gives logits of order one, so a swapped tensor shows; ``changes``
    replace config fields."""
    class_name, extra = CONFIGS[name]
    shape = {} if name == "gpt2" else SHAPE
    config = getattr(transformers, class_name)(**{**shape, **extra, **changes})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            gain = param_name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"))
            base = 1.0 if gain else 0.0
            param.copy_(base + 0.3 * torch.randn_like(param))
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    return model
