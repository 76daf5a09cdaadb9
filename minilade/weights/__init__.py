"""Checkpoint resolution and weight loading (Hugging Face safetensors and GGUF) into one canonical state dict."""
