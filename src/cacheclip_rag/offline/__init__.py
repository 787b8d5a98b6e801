"""Offline work that serves the request path but never runs inside a request.

calibrate.py (which aux layers score, per model pair and length), reference.py (full-attention
reference answers and their logits), training.py + train_packets.py + train_lora.py (the two
self-distillation trainers and what they share), traindata.py / niah.py / haystack.py (synthetic
corpora and requests), overlap.py (character-space overlap of two tokenizers' weights).
"""
