"""memfit: pretrain and fine-tune open decoder models (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, Phi-3 and
mixtures of experts) in the least memory at full speed."""

__version__ = "0.1.0"
