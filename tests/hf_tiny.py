"""A tiny Hugging Face checkpoint directory built offline: a byte-level BPE ``tokenizer.json``
trained on a few sentences, ``tokenizer_config.json`` with a ChatML chat template (Qwen2's
format), and optionally a random Qwen2 model written by transformers."""

import json
from pathlib import Path

#: Qwen2's ChatML format (its default system message included), the shape of its chat template.
CHATML = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have? #### 7",
    "You are a helpful assistant. Let's think step by step and output the final answer after ####.",
    "system user assistant 0 1 2 3 4 5 6 7 8 9 + - * / = ? . ,",
]


def tokenizer_dir(path, *, chat_template: str | None = CHATML, vocab_size: int = 320) -> Path:
    """``path`` with ``tokenizer.json`` and ``tokenizer_config.json`` (pad/eos ``<|endoftext|>``,
    no BOS, like Qwen2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": 512}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def qwen2_dir(path, *, max_position_embeddings: int = 128, tie: bool = True, seed: int = 0) -> Path:
    """A random 2-layer Qwen2 checkpoint (safetensors, config.json) with :func:`tokenizer_dir`'s files."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    path = tokenizer_dir(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.Qwen2Config(
        vocab_size=-(-vocab // 8) * 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0,
        torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def tiny_reward_model(path, *, seed: int = 0, scale: float = 1.0) -> str:
    """An rljax ``tiny``-shaped Qwen2ForSequenceClassification checkpoint (the policy's vocabulary),
    random backbone and score head, written with rljax's own export (no torch needed)."""
    import dataclasses

    import jax

    from rljax import models

    config = dataclasses.replace(models.get_config("tiny"), tie_embeddings=True)
    _, params = models.init_params(config, seed=seed)
    head = models.RewardHead("Qwen2ForSequenceClassification", 1, False)
    score = scale * jax.random.normal(jax.random.key(seed), (config.hidden_size, 1))
    models.save_hf_reward_model(str(path), config, head, params, score)
    return str(path)
