"""memfit: pretrain and fine-tune Llama-family models in the least memory at full speed."""

__version__ = "0.1.0"
