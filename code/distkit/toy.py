"""Tiny models and data, built here: nothing is downloaded (HF_HUB_OFFLINE=1 holds).

The model is a real transformers LlamaForCausalLM, only small; the data are "counting"
sequences x_t = (start + step * t) mod vocab, which the model can learn, so the loss visibly
falls from ln(vocab) towards zero. `warmup_cosine` is the LR schedule of chapter 05's runs
(one copy: a checkpoint resumed by another script must meet the same schedule).
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset


def tiny_llama(vocab_size: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
               seq_len: int = 32):
    """A LlamaForCausalLM from a config, randomly initialised from torch's current seed."""
    from transformers import LlamaConfig, LlamaForCausalLM  # slow import: only when needed
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=seq_len,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def counting_data(num_samples: int = 256, seq_len: int = 32, vocab_size: int = 128,
                  max_step: int = 4, seed: int = 1234) -> TensorDataset:
    """num_samples sequences x_t = (start + step*t) % vocab_size, the same for every seed."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
    step = torch.randint(1, max_step + 1, (num_samples, 1), generator=g)
    tokens = (start + step * torch.arange(seq_len)) % vocab_size
    return TensorDataset(tokens)


def warmup_cosine(optimizer, total_steps: int):
    """A LambdaLR: linear warm-up over the first tenth of the steps, then cosine decay to 0."""
    warmup = max(1, total_steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))))
