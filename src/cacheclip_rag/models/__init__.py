"""Models: resolving and loading the primary and aux models, their families, RoPE, LoRA merges.

loading.py (embedded GGUF packages, local folders, cached hub ids -> `LoadedModel`), families/
(one adapter per architecture: layers, norms, RoPE per layer, windows), rope.py (moving cached
keys between positions), lora.py (the concatenation-aware LoRA: attach, save, check, merge).
"""
