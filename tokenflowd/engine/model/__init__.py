"""The model: the Llama-family decoder (llama.py), its config, the weight loaders (GGUF, Hugging
Face, dummy), quantization and packing, and the fast logits head."""
