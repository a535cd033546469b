"""A tiny causal LM built on the spot for learner tests: a byte-level BPE tokenizer trained on
a few kernel snippets with the prompt format's special tokens and chat template, and a
randomly initialized two-layer Qwen2. Builds in about a second; nothing is downloaded.

(The policy issue's session fixture `tiny_model_dir` is the warm-started model of the demo;
learner tests need only a real transformer with a real tokenizer, and one they can rebuild
with different seeds.)
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    '```cpp\nextern "C" void relu(const float* x, float* y, int64_t n) {\n'
    "  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] : 0;\n}\n```",
    "Task relu: ReLU. y[i] = max(x[i], 0) for i < n. Answer with one ```cpp block.",
    "Compilation failed: error: 'yy' was not declared in this scope. Fix the code.",
    "Wrong output y: 4 of 64 values wrong; at index 7 expected 1.5, got -1.5.",
    "Correct. Speedup 1.73x over the reference. Make it faster.",
]


def build_tiny_model(directory: str | Path, seed: int = 0, *, layers: int = 2, hidden: int = 64,
                     vocab_size: int = 384) -> Path:
    """Write a tiny Qwen2 model directory (config, safetensors, tokenizer) and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from leap import prompts

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|endoftext|>", *prompts.SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token=prompts.END_OF_TURN,
                                        additional_special_tokens=[t for t in special if t not in ("<|pad|>", prompts.END_OF_TURN)])
    tokenizer.chat_template = prompts.SIMPLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    return directory
