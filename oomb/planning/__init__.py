"""Planning a step: how much memory it takes, whether it fits, and which OOMBConfig is fastest that fits.

    model_shape.py    a model's shape from its Hugging Face config: sizes, parameter counts by part
    activations.py    activation and logits bytes per token of a chunk's forward and backward
    memory.py         predicted GPU and host memory of a step, term by term (predict)
    fit.py            the memory a step may use (Budget) and the longest context that fits (largest_context)
    choose.py         the fastest OOMBConfig that fits the free memory (choose_config), from measured speed factors

The training run (oomb.training) and the tools (`oomb plan`, `oomb bench`) import it; it imports only the
step's modules below it.
"""
