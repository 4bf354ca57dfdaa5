"""Attention over the paged KV store: the reference (PyTorch), Triton and cuDNN backends, dense and sparse,
and the autograd function the models' attention layers call (function.py)."""
